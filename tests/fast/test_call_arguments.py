"""`sandbox-server call --arg KEY=VALUE`: a value is read as the tool's argument takes it."""

from sandbox_server.cli.call_arguments import call_arguments


def test_an_arg_is_json_where_the_tools_argument_is_not_text_and_a_string_where_it_is() -> None:
    said = call_arguments(
        "analyze_csv",
        ["filepath=2025.csv", "drop_totals=true", "max_groups=20", 'operations=["sum"]', "timeout_s=5", "header_row=3"],
        None,
        [],
    )
    assert said == {
        "filepath": "2025.csv", "drop_totals": True, "max_groups": 20, "operations": ["sum"], "timeout_s": 5,
        "header_row": 3,
    }  # fmt: skip
    shell = call_arguments("sbx_execute_command", ["command=123", "reset=false", "tty=true"], '{"stdin": "x"}', [])
    assert shell == {"stdin": "x", "command": "123", "reset": False, "tty": True}
    assert call_arguments("nope", ["a=true"], None, []) == {"a": "true"}  # the server names an unknown tool
