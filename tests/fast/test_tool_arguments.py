"""Pure checks of tool arguments before anything reaches the engine."""

import pytest

from sandbox_server.tools.arguments import workspace_folder


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("/workspace", ""),
        ("/workspace/", ""),
        (".", ""),
        ("sub/dir", "sub/dir"),
        ("/workspace/a//b/", "a/b"),
        ("/proc/self/fd/7", None),
        ("/workspacex", None),
        ("..", None),
        ("/workspace/../etc", None),
        ("a/../../b", None),
        ("x" * 256, None),
    ],
)
def test_a_working_folder_is_the_workspace_or_under_it(given: str, expected: str | None) -> None:
    assert workspace_folder(given) == expected
