"""The public names of journeyman_agents, pinned in public_names.txt beside this file: the API
changes only on purpose."""

from _support import check_public_names


def test_public_names() -> None:
    check_public_names("journeyman_agents", __file__)
