"""The public names of journeyman_mcp, pinned in public_names.txt beside this file: the API
changes only on purpose."""

from _support import check_public_names


def test_public_names() -> None:
    check_public_names("journeyman_mcp", __file__)
