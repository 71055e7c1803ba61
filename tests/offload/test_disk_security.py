"""The disk tier in a directory others can reach: modes, symlinks, ownership, temp names."""

import os
import stat

import pytest
import torch

from lessmem.offload import DiskTier
from lessmem.offload import blockdir as bd


def blk(i, n=256):
    return {"x": torch.full((n,), float(i)), "i": torch.tensor([i])}


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_files_0600_dirs_0700(tmp_path):
    old = os.umask(0)  # even with a permissive umask
    try:
        t = DiskTier(tmp_path / "store")
        t.put("a", blk(1))
    finally:
        os.umask(old)
    root = tmp_path / "store"
    assert _mode(root) == 0o700 and _mode(root / "blocks") == 0o700 and _mode(root / "clients") == 0o700
    assert _mode(root / "blocks" / "a.blk") == 0o600 and _mode(root / "lock") == 0o600
    assert all(_mode(p) == 0o600 for p in (root / "clients").iterdir())


def test_older_store_with_looser_subdirs_is_tightened(tmp_path):
    (tmp_path / "blocks").mkdir(mode=0o755)
    os.chmod(tmp_path / "blocks", 0o755)
    DiskTier(tmp_path).put("a", blk(1))
    assert _mode(tmp_path / "blocks") == 0o700


def test_planted_symlink_at_the_temp_name_is_never_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    store = tmp_path / "store"
    t = DiskTier(store)
    names = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(bd.secrets, "token_hex", lambda n: next(names))
    planted = store / "blocks" / f"{bd.TEMP_PREFIX}{t.store.client}.aaaa"
    planted.symlink_to(victim)  # an attacker who guessed the next temp name
    t.put("a", blk(1))
    assert victim.read_bytes() == b"precious" and planted.is_symlink()
    assert t.get("a")["i"].item() == 1


def test_planted_symlink_at_the_block_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    t = DiskTier(tmp_path / "store")
    link = tmp_path / "store" / "blocks" / "a.blk"
    link.symlink_to(victim)
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert t.get("a") is None  # not followed on read
    assert t.stats.errors == 1
    t.put("a", blk(2))  # the rename replaces the link itself
    assert victim.read_bytes() == b"precious" and not link.is_symlink()
    assert t.get("a")["i"].item() == 2


def test_refuses_a_directory_of_another_user(tmp_path, monkeypatch):
    real = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real + 4242)  # now tmp_path belongs to "someone else"
    with pytest.raises(ValueError, match=f"owned by uid {real}, not by this user"):
        DiskTier(tmp_path)
    assert not (tmp_path / "blocks").exists()


def test_refuses_group_or_world_writable_without_sticky(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(ValueError, match="writable by group/others.*without the sticky bit"):
        DiskTier(d)
    os.chmod(d, 0o775)
    with pytest.raises(ValueError, match="not safe"):
        DiskTier(d)
    os.chmod(d, 0o1777)  # sticky: others cannot move our blocks/ away
    DiskTier(d).put("a", blk(1))
    assert _mode(d / "blocks") == 0o700


def test_root_owned_sticky_dir_like_tmp_is_accepted(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs a root-owned directory: run as root")
    d = tmp_path / "tmpish"
    d.mkdir()
    os.chmod(d, 0o1777)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # a normal user in root's /tmp-like dir
    bd._check_top(str(d))  # accepted
    os.chmod(d, 0o777)
    with pytest.raises(ValueError, match="owned by uid 0"):
        bd._check_top(str(d))


def test_refuses_blocks_dir_that_is_a_symlink_or_not_ours(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = tmp_path / "store"
    store.mkdir()
    (store / "blocks").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symlink or a file is in its place"):
        DiskTier(store)
    if os.geteuid() == 0:  # root can make a directory that belongs to someone else
        (store / "blocks").unlink()
        (store / "blocks").mkdir()
        os.chown(store / "blocks", 65534, 65534)
        with pytest.raises(ValueError, match="owned by uid 65534"):
            DiskTier(store)


def test_keys_that_look_like_temp_names_are_ordinary_keys(tmp_path):
    keys = [".tmp.1.2", ".tmp.999999999.0", "+tmp", ".tmp.x"]
    ok = [k for k in keys if not k.startswith("+")]
    t = DiskTier(tmp_path)
    for i, k in enumerate(ok):
        t.put(k, blk(i))
    with pytest.raises(ValueError, match="invalid"):
        t.put("+tmp.x", blk(0))  # '+' (the temp prefix) is outside the key alphabet
    t2 = DiskTier(tmp_path)  # reopening (which removes dead writers' temp files) keeps them
    assert sorted(t2.keys()) == sorted(ok)
    assert [t2.get(k)["i"].item() for k in ok] == list(range(len(ok)))


def test_legacy_temp_files_of_dead_writers_are_removed(tmp_path):
    DiskTier(tmp_path).put("a", blk(1))
    dead = tmp_path / "blocks" / ".tmp.999999999.3"  # an older version's temp name, no such pid
    dead.write_bytes(b"partial")
    live = tmp_path / "blocks" / f".tmp.{os.getpid()}.4"
    live.write_bytes(b"partial")
    t = DiskTier(tmp_path)
    assert not dead.exists() and live.exists() and t.keys() == ["a"]


def test_a_symlink_in_place_of_the_lock_file_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / "lock").symlink_to(victim)
    with pytest.raises(ValueError, match="not a symlink"):
        DiskTier(store)
    assert victim.read_bytes() == b"precious"
