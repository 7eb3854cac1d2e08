"""Crash-safe files and directories: a failed write leaves the old state and no debris."""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_recipes.files import crashsafe
from dflash_recipes.files.crashsafe import (
    atomic_replace,
    remove_staging_dirs,
    remove_stale_staging,
    staged_directory,
    staging_name,
    write_new_file,
)


def test_write_new_file_never_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "recipe.yaml"
    assert write_new_file(path, "first\n") is True
    assert write_new_file(path, "second\n") is False
    assert path.read_text(encoding="utf-8") == "first\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["recipe.yaml"]


def test_atomic_replace_keeps_the_old_file_when_the_writer_fails(tmp_path: Path) -> None:
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="killed"), atomic_replace(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]
    with atomic_replace(path) as tmp:
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]


def test_staged_directory_publishes_whole_or_not_at_all(tmp_path: Path) -> None:
    out = tmp_path / "export"
    with staged_directory(out) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".tmp-export-")
        (staging / "a.txt").write_text("one", encoding="utf-8")
    assert (out / "a.txt").read_text(encoding="utf-8") == "one"

    with pytest.raises(OSError, match="disk full"), staged_directory(out) as staging:
        (staging / "a.txt").write_text("two", encoding="utf-8")
        raise OSError("disk full")
    assert (out / "a.txt").read_text(encoding="utf-8") == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_staged_directory_removes_staging_when_publishing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*_args: object) -> None:
        raise RuntimeError("killed before the rename")

    monkeypatch.setattr(crashsafe, "publish_directory", crash)
    with pytest.raises(RuntimeError, match="killed"), staged_directory(tmp_path / "out") as s:
        (s / "f").write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []


def test_published_files_get_the_default_permissions(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with staged_directory(tmp_path / "out") as staging:
            private = staging / "private.bin"
            private.write_bytes(b"x")
            private.chmod(0o600)
    finally:
        os.umask(old)
    assert (tmp_path / "out" / "private.bin").stat().st_mode & 0o777 == 0o644


def test_stale_staging_of_dead_writers_is_removed_live_ones_kept(tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    dead = tmp_path / ".old-drafter-999999999-0123abcd"
    mine = staging_name(out, "89abcdef")  # this process's own leftover
    live = tmp_path / f".tmp-drafter-{os.getppid()}-fedcba98"
    unrelated = tmp_path / ".tmp-other-999999999-0123abcd"
    for directory in (dead, mine, live, unrelated):
        directory.mkdir()
    assert sorted(remove_stale_staging(out)) == sorted([dead, mine])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, unrelated.name])


def test_remove_staging_dirs_takes_only_matching_directories(tmp_path: Path) -> None:
    (tmp_path / ".tmp-checkpoint-00000001-dead").mkdir()
    (tmp_path / ".tmp-checkpoint-note").write_text("a file, not staging", encoding="utf-8")
    (tmp_path / "checkpoint-00000001").mkdir()
    remove_staging_dirs(tmp_path, ".tmp-checkpoint-")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-checkpoint-note",
        "checkpoint-00000001",
    ]


def test_publishing_syncs_each_file_and_the_staging_dir_before_the_rename_then_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the order is the guarantee: data on disk before the new name points at it, and the
    # parent directory (which holds the name) synced after the rename
    out = tmp_path / "export"
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def rename(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        events.append(("rename", Path(dst).name))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    with staged_directory(out) as staging:
        (staging / "model.safetensors").write_bytes(b"weights")
        (staging / "config.json").write_text("{}")
    staged = staging.name
    assert sorted(events[:2]) == [("fsync", "config.json"), ("fsync", "model.safetensors")]
    assert events[2:] == [("fsync", staged), ("rename", "export"), ("fsync", tmp_path.name)]
    assert (out / "model.safetensors").read_bytes() == b"weights"


# ---------------------------------------------------------------------------------------------
# a failure injected at each step of publishing: what survives on disk
# ---------------------------------------------------------------------------------------------


def _export(out: Path, content: str) -> None:
    with staged_directory(out) as staging:
        (staging / "model.safetensors").write_text(content, encoding="utf-8")
        (staging / "config.json").write_text("{}", encoding="utf-8")


def _on_disk(parent: Path) -> dict[str, str]:
    return {
        str(p.relative_to(parent)): p.read_text(encoding="utf-8")
        for p in sorted(parent.rglob("*"))
        if p.is_file()
    }


def _fail_nth(
    monkeypatch: pytest.MonkeyPatch, name: str, n: int, events: list[str] | None = None
) -> None:
    """Make the n-th call (1-based) of os.`name` raise EIO; the others run for real."""
    real = getattr(os, name)
    calls = [0]

    def failing(*args: object) -> object:
        calls[0] += 1
        if events is not None:
            events.append(name)
        if calls[0] == n:
            raise OSError(5, f"injected {name} failure")
        return real(*args)

    monkeypatch.setattr(os, name, failing)


OLD = {"export/config.json": "{}", "export/model.safetensors": "old"}
NEW = {"export/config.json": "{}", "export/model.safetensors": "new"}


def test_replacing_an_export_syncs_retires_renames_then_syncs_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export"
    _export(out, "old")
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def rename(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        events.append(("rename", f"{Path(src).name} -> {Path(dst).name}"))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    with staged_directory(out) as staging:
        (staging / "model.safetensors").write_text("new", encoding="utf-8")
    retire, publish = events[2][1], events[3][1]
    assert events[:2] == [("fsync", "model.safetensors"), ("fsync", staging.name)]
    assert retire.startswith("export -> .old-export-") and publish == f"{staging.name} -> export"
    assert events[4:] == [("fsync", tmp_path.name)]
    # the retired old directory is gone once the new one is in place
    assert _on_disk(tmp_path) == {"export/model.safetensors": "new"}


@pytest.mark.parametrize(
    ("call", "n", "step"),
    [
        ("fsync", 1, "syncing the first staged file"),
        ("fsync", 3, "syncing the staging directory"),
        ("rename", 1, "retiring the old directory"),
        ("rename", 2, "renaming the new one into place"),
    ],
)
def test_a_failure_before_the_new_directory_is_in_place_keeps_the_old_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, n: int, step: str
) -> None:
    out = tmp_path / "export"
    _export(out, "old")
    _fail_nth(monkeypatch, call, n)
    with pytest.raises(OSError, match=f"injected {call} failure"):
        _export(out, "new")
    # the old export, whole, under its name; no staging or retired directory left
    assert _on_disk(tmp_path) == OLD, step
    assert [p.name for p in tmp_path.iterdir()] == ["export"], step


def test_a_failure_syncing_the_parent_reports_it_with_the_new_directory_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export"
    _export(out, "old")
    _fail_nth(monkeypatch, "fsync", 4)  # 2 files, the staging dir, then the parent
    with pytest.raises(OSError, match="injected fsync failure"):
        _export(out, "new")
    assert _on_disk(tmp_path) == NEW
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_a_first_export_that_fails_to_rename_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_nth(monkeypatch, "rename", 1)
    with pytest.raises(OSError, match="injected rename failure"):
        _export(tmp_path / "export", "new")
    assert list(tmp_path.iterdir()) == []


def test_publishing_over_a_file_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    out = tmp_path / "export"
    out.write_text("a file", encoding="utf-8")
    with pytest.raises(FileExistsError, match="exists and is not a directory; choose another"):
        _export(out, "new")
    assert _on_disk(tmp_path) == {"export": "a file"}


def test_a_failed_replace_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    crashsafe.write_text_atomic(path, "old")
    _fail_nth(monkeypatch, "replace", 1)
    with pytest.raises(OSError, match="injected replace failure"):
        crashsafe.write_text_atomic(path, "new")
    assert _on_disk(tmp_path) == {"plan.json": "old"}
    monkeypatch.undo()
    crashsafe.write_bytes_atomic(tmp_path / "sub" / "shard.bin", b"\x00\x01")
    assert (tmp_path / "sub" / "shard.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["shard.bin"]


def test_write_new_file_without_hard_links_creates_exclusively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*_args: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "dir" / "recipe.yaml"
    assert write_new_file(path, "first") is True
    assert write_new_file(path, "second") is False
    assert _on_disk(tmp_path) == {"dir/recipe.yaml": "first"}


# ---------------------------------------------------------------------------------------------
# user-named outputs, new files and the names of temporaries
# ---------------------------------------------------------------------------------------------


def test_write_output_replaces_a_file_and_follows_a_link(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "plan.json"
    assert crashsafe.write_output(path, "one") == path
    assert path.read_text() == "one"
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert crashsafe.write_output(link, b"new") == target
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json", "sub"]


def test_write_output_writes_through_a_fifo_and_refuses_a_directory(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as handle:
            received.append(handle.read())

    reader = threading.Thread(target=read)
    reader.start()
    payload = b"x" * 200_000  # more than a pipe holds: written in several writes
    assert crashsafe.write_output(fifo, payload) == fifo
    reader.join(timeout=30)
    assert received == [payload] and stat.S_ISFIFO(fifo.stat().st_mode)
    with pytest.raises(IsADirectoryError) as caught:
        crashsafe.write_output(tmp_path, "x")
    assert caught.value.errno == errno.EISDIR and caught.value.filename == str(tmp_path)


def test_write_new_file_creates_folders_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "recipe.yaml"
    assert write_new_file(path, "x: 1\n") is True
    assert write_new_file(path, "x: 2\n") is False
    assert path.read_text() == "x: 1\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["recipe.yaml"]


def test_temporaries_are_hidden_siblings_named_after_their_writer(tmp_path: Path) -> None:
    pid = os.getpid()
    assert crashsafe.temporary_sibling(tmp_path / "plan.json") == tmp_path / f".plan.json.tmp-{pid}"
    assert staging_name(tmp_path / "export", "0123abcd") == tmp_path / f".tmp-export-{pid}-0123abcd"
    assert staging_name(tmp_path / "export", "0123abcd", kind="old").name == (
        f".old-export-{pid}-0123abcd"
    )


def test_only_directories_named_like_staging_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    keep_file = tmp_path / ".tmp-drafter-999999999-0123abcd"
    keep_file.write_text("not a directory")
    keep_link = tmp_path / ".old-drafter-999999998-0123abcd"
    keep_link.symlink_to(tmp_path)
    too_long = tmp_path / ".tmp-drafter-99999999999-0123abcd"  # 11 digits: not a pid
    bad_token = tmp_path / ".tmp-drafter-999999999-0123abcz"
    no_pid = tmp_path / ".tmp-drafter-0123abcd"  # older writers put no pid in the name
    for directory in (too_long, bad_token, no_pid):
        directory.mkdir()
    assert remove_stale_staging(out) == [no_pid]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [keep_file.name, keep_link.name, too_long.name, bad_token.name]
    )
    assert remove_stale_staging(tmp_path / "absent" / "drafter") == []


def test_remove_staging_dirs_leaves_symlinks(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".tmp-checkpoint-link").symlink_to(tmp_path / "elsewhere")
    remove_staging_dirs(tmp_path, ".tmp-checkpoint-")
    assert (tmp_path / ".tmp-checkpoint-link").is_symlink()


def test_a_pid_is_alive_unless_the_kernel_says_there_is_no_such_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert crashsafe._alive(os.getpid())

    def denied(_pid: int, _signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", denied)
    assert crashsafe._alive(12345)  # another user's process: alive

    def gone(_pid: int, _signal: int) -> None:
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(os, "kill", gone)
    assert not crashsafe._alive(12345)


def test_atomic_writes_create_missing_folders_and_return_the_path_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashsafe.write_text_atomic(tmp_path / "a" / "b" / "plan.json", "{}")
    crashsafe.write_bytes_atomic(tmp_path / "c" / "d" / "shard.bin", b"\x00")
    assert _on_disk(tmp_path) == {"a/b/plan.json": "{}", "c/d/shard.bin": "\x00"}
    monkeypatch.chdir(tmp_path)
    assert crashsafe.write_output(Path("rel") / "out.txt", "x") == Path("rel") / "out.txt"
    with pytest.raises(IsADirectoryError) as caught:
        crashsafe.write_output(Path("rel"), "x")
    assert caught.value.strerror == "Is a directory"


def test_a_failed_write_of_a_new_file_says_why_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*_args: object, **_kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError) as caught:
        write_new_file(tmp_path / "recipe.yaml", "x: 1\n")
    assert caught.value.errno == 28  # not a FileNotFoundError from the cleanup
    assert list(tmp_path.iterdir()) == []


def test_a_retired_directory_is_named_so_the_next_writer_can_clean_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export"
    _export(out, "old")
    renamed: list[str] = []
    real_rename = os.rename

    def rename(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        renamed.append(Path(dst).name)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    _export(out, "new")
    assert re.fullmatch(rf"\.old-export-{os.getpid()}-[0-9a-f]{{8}}", renamed[0]), renamed


def test_a_directory_that_cannot_be_removed_does_not_stop_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export"
    _export(out, "old")
    stale = tmp_path / ".tmp-export-999999999-0123abcd"
    (stale / "sub").mkdir(parents=True)
    (tmp_path / ".tmp-checkpoint-1-dead" / "sub").mkdir(parents=True)

    def busy(*_args: object, **_kwargs: object) -> None:
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(os, "rmdir", busy)
    assert remove_stale_staging(out) == [stale]  # tried, and reported as handled
    remove_staging_dirs(tmp_path, ".tmp-checkpoint-")
    _export(out, "new")  # the retired old export cannot be removed either
    assert (out / "model.safetensors").read_text() == "new"


def test_a_live_writer_is_passed_over_and_the_dead_after_it_still_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "drafter"
    live = tmp_path / f".tmp-drafter-{os.getppid()}-fedcba98"
    dead = tmp_path / ".tmp-drafter-999999999-0123abcd"
    for directory in (live, dead):
        directory.mkdir()
    real_iterdir = Path.iterdir

    def live_first(self: Path) -> Iterator[Path]:
        return iter(sorted(real_iterdir(self), key=lambda p: p != live))

    monkeypatch.setattr(Path, "iterdir", live_first)
    assert remove_stale_staging(out) == [dead]
    assert [p.name for p in real_iterdir(tmp_path)] == [live.name]


def test_liveness_is_asked_with_signal_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    assert crashsafe._alive(4242)
    assert sent == [(4242, 0)]  # signal 0 only asks; any other would be delivered
