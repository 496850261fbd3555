"""What a call changed in its workspace, from its files' states before and after (pure logic)."""

from __future__ import annotations

from sandbox_server.workspaces.changes import MAX_CHANGES, changes_between, changes_line


def test_created_modified_deleted_renamed_and_a_file_made_and_removed_in_the_call() -> None:
    before = {"a.txt": (1, 10, 101), "b.txt": (2, 10, 102), "c.txt": (3, 10, 103), "same.txt": (4, 10, 104)}
    after = {
        "a.txt": (5, 20, 101),  # appended to
        "d.txt": (3, 10, 103),  # c.txt, renamed (its inode under another name)
        "same.txt": (4, 10, 104),
        "new.txt": (2, 20, 102),  # b.txt's inode reused, and even its size: a new file all the same
        # b.txt deleted; a file made and removed within the call was never seen, so it is no change
    }
    changes = changes_between(before, after)
    assert changes == {
        "created": ["new.txt"],
        "modified": ["a.txt"],
        "deleted": ["b.txt"],
        "renamed": [{"from": "c.txt", "to": "d.txt"}],
        "more": 0,
    }
    assert changes_line(changes) == (
        "workspace changes: 1 created, 1 modified, 1 deleted, 1 renamed (new.txt, a.txt, b.txt, c.txt -> d.txt)"
    )


def test_a_file_replaced_under_its_name_is_modified_and_without_inodes_a_rename_is_two_changes() -> None:
    replaced = changes_between({"f": (1, 10, 7)}, {"f": (1, 10, 8)})
    assert replaced["modified"] == ["f"]
    archived = changes_between({"c.txt": (3, 10, 0)}, {"d.txt": (3, 10, 0)})  # an archive keeps no inode
    assert archived["created"] == ["d.txt"] and archived["deleted"] == ["c.txt"] and not archived["renamed"]


def test_the_list_is_bounded_the_rest_counted_and_the_tools_own_folders_left_out() -> None:
    after = {f"f{i:03}": (1, 1, i + 1) for i in range(120)} | {".sandbox/cell-state.pickle": (9, 9, 999)}
    changes = changes_between({".local/lib/x.py": (1, 1, 1000)}, after)
    assert len(changes["created"]) == MAX_CHANGES and changes["more"] == 120 - MAX_CHANGES
    assert not changes["deleted"] and ".sandbox/cell-state.pickle" not in changes["created"]
    assert changes_line(changes).startswith(f"workspace changes: {MAX_CHANGES} created and 70 more (f000, f001")
    assert changes_line(changes_between({}, {})) == ""


def test_a_name_that_is_not_utf8_is_shown_escaped() -> None:
    assert changes_between({}, {"bad-\udcff.txt": (1, 1, 1)})["created"] == ["bad-\\xff.txt"]
