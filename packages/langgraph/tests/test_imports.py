"""The public names of journeyman_langgraph, pinned in public_names.txt beside this file: the API
changes only on purpose."""

from _support import check_public_names


def test_public_names() -> None:
    check_public_names("journeyman_langgraph", __file__)
