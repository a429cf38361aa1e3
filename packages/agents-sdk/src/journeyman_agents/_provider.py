"""A `ModelProvider` that serves every agent's model from a Journeyman endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from agents.models.interface import Model, ModelProvider
from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
from agents.models.openai_responses import OpenAIResponsesModel
from journeyman import InvalidFieldError

if TYPE_CHECKING:
    from journeyman import TrainableModel
    from openai import AsyncOpenAI

ModelAPI = Literal["responses", "chat_completions"]


class JourneymanModelProvider(ModelProvider):
    """Resolves any model name (an agent's `model="gpt-..."` or none) to `model`'s endpoint.

    `api` picks the SDK model class: `"responses"` (the SDK's default, `OpenAIResponsesModel`,
    served by the endpoint's `/v1/responses`) or `"chat_completions"` (`OpenAIChatCompletionsModel`).
    Agents whose `model` is a `Model` instance are not resolved through a provider and so are not
    served (nor captured) by Journeyman.
    """

    def __init__(self, model: TrainableModel, api: ModelAPI = "responses") -> None:
        if api not in ("responses", "chat_completions"):
            raise InvalidFieldError("api", api, "use 'responses' or 'chat_completions'")
        self.model = model
        self.api: ModelAPI = api
        self._client: AsyncOpenAI | None = None

    @property
    def client(self) -> AsyncOpenAI:
        # model.openai_client() stamps the capture header of the calling task on every request.
        if self._client is None:
            self._client = self.model.openai_client()
        return self._client

    def get_model(self, model_name: str | None) -> Model:
        if self.api == "responses":
            return OpenAIResponsesModel(model=self.model.name, openai_client=self.client)
        return OpenAIChatCompletionsModel(model=self.model.name, openai_client=self.client)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
