"""One directory, one role: a tiered manager's local tier shares its directory
with nothing (issue #29, item 3, and its class).

``CheckpointManager(r, local_dir=r, keep=3, local_keep=1)`` used to be
accepted, and after four steps the root held one: local retention deleted
the steps ``keep`` promised. Every spelling of one directory (trailing
``/``, ``file://``, ``..``, relative, symlinks; MSC's POSIX profile, by
``enable_msc`` or by an ``msc://`` profile), a local tier inside or above
the root, and a local tier that another open manager uses in any role is
refused with ``InvalidArgument`` naming both, before anything is written;
so is ``dcpstore ls --local-dir`` over the root itself. Directories that
only share a prefix of their names, and roots shared between managers, are
accepted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcpstore
from tests.support.hostile_kit import cli


def _tiered(root: str, local: str, **kwargs: object) -> dcpstore.CheckpointManager:
    return dcpstore.CheckpointManager(root, local_dir=local, async_=False, **kwargs)  # type: ignore[arg-type]


def _refused(root: str, local: str, **kwargs: object) -> str:
    with pytest.raises(dcpstore.InvalidArgument) as info:
        _tiered(root, local, **kwargs).close()
    message = str(info.value)
    assert f"local_dir {local!r}" in message and f"root_uri {root!r}" in message, message
    return message


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.mark.parametrize("spell", ["{r}", "{r}/", "file://{r}", "{r}//", "{r}/.", "{r}/../{name}"])
def test_the_root_as_local_dir_is_refused_however_spelt(tmp_path: Path, spell: str) -> None:
    """The issue's configuration: refused, naming both, nothing written (before
    the fix it was accepted, and steps 1-4 left the root holding [4])."""
    root = tmp_path / "run"
    root.mkdir()
    local = spell.format(r=root, name=root.name)
    message = _refused(str(root), local, keep=3, local_keep=1)
    assert "is the same directory as" in message and "Nothing was written" in message
    assert _files(root) == []


def test_a_local_tier_inside_or_above_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert "is inside" in _refused(str(root), str(root / "nvme"))
    assert "holds" in _refused(str(root), str(tmp_path))
    assert "is inside" in _refused(str(root), str(root / "a" / "b" / "c"))  # none of it exists yet
    assert _files(tmp_path) == []


def test_directories_that_only_share_a_name_prefix_are_apart(tmp_path: Path) -> None:
    with _tiered(str(tmp_path / "run1"), str(tmp_path / "run10"), keep=3, local_keep=1) as mgr:
        for step in range(1, 5):
            mgr.save({"w": torch.full((4,), float(step))}, step)
        mgr.wait()
    assert dcpstore.CheckpointManager(str(tmp_path / "run1")).all_steps() == [2, 3, 4]  # keep=3 kept its three
    assert dcpstore.CheckpointManager(str(tmp_path / "run10")).all_steps() == [4]  # and local_keep=1 its one


def test_symlinks_and_relative_paths_are_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "real" / "run"
    root.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "run-link").symlink_to(root)
    _refused(str(root), str(tmp_path / "run-link"))
    _refused(str(tmp_path / "link" / "run"), str(root))
    assert "is inside" in _refused(str(tmp_path / "link"), str(root / "nvme"))
    monkeypatch.chdir(tmp_path / "real")
    _refused("run", str(root))
    _refused(str(root), "./run/")
    _refused(str(root), "../link/run")


def test_a_bind_mount_of_the_root_is_the_root(tmp_path: Path) -> None:
    """Where no path resolves to the other, device and inode still tell: a
    bind mount, made in a mount namespace of its own (``unshare -m``)."""
    root, alias = tmp_path / "run", tmp_path / "mnt"
    root.mkdir()
    alias.mkdir()
    code = (
        "import dcpstore\n"
        "try:\n"
        f"    dcpstore.CheckpointManager({str(root)!r}, local_dir={str(alias / 'nvme')!r}, async_=False)\n"
        "except dcpstore.InvalidArgument as e:\n"
        "    print(e)\n"
    )
    script = f'mount --bind {root} {alias} && exec {sys.executable} -c "$0"'
    try:
        out = subprocess.run(["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot bind-mount here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    assert f"local_dir {str(alias / 'nvme')!r} is inside root_uri {str(root)!r}" in out.stdout, out.stdout


def test_msc_posix_profiles_are_the_directory_they_map_to(tmp_path: Path) -> None:
    """``enable_msc=True`` over a plain path (MSC's POSIX profile), and an
    ``msc://`` profile whose base path is the local tier."""
    root = tmp_path / "run"
    _refused(
        str(root), str(root), options=dcpstore.SaveOptions(storage_options=dcpstore.StorageOptions(enable_msc=True))
    )
    config = tmp_path / "msc.yaml"
    config.write_text(
        f"profiles:\n  disk:\n    storage_provider:\n      type: file\n      options:\n        base_path: {tmp_path}\n"
    )
    code = (
        "import dcpstore\n"
        "try:\n"
        f"    dcpstore.CheckpointManager('msc://disk/run', local_dir={str(root) + '/'!r}, async_=False)\n"
        "except dcpstore.InvalidArgument as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "MSC_CONFIG": str(config)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "is the same directory as root_uri 'msc://disk/run'" in out.stdout, out.stdout


def test_a_local_tier_is_shared_with_no_other_open_manager(tmp_path: Path) -> None:
    local, other = str(tmp_path / "t" / "nvme"), str(tmp_path / "nvme2")
    first = _tiered(str(tmp_path / "a"), local)
    try:
        for make in (
            lambda: _tiered(str(tmp_path / "b"), local + "/"),  # another root, the same local tier
            lambda: _tiered(local, other),  # that local tier as a durable root
            lambda: dcpstore.CheckpointManager(local),  # ... or as a plain manager's root
            lambda: _tiered(str(tmp_path / "b"), str(tmp_path / "t")),  # a local tier holding it
        ):
            with pytest.raises(dcpstore.InvalidArgument, match="of the open CheckpointManager for"):
                make().close()
        # A root is one role however many managers read it.
        dcpstore.CheckpointManager(str(tmp_path / "a")).close()
    finally:
        first.close()
    _tiered(str(tmp_path / "b"), local).close()  # free again once the first closed


def test_ls_refuses_a_local_dir_that_is_the_root(tmp_path: Path) -> None:
    dcpstore.save({"w": torch.ones(3)}, str(tmp_path / "run" / "step_00000001"))
    code, out, err = cli("ls", str(tmp_path / "run"), "--local-dir", f"file://{tmp_path}/run/")
    assert code == 2 and not out, out
    assert "--local-dir 'file://" in err and "is the same directory as URI" in err, err
    assert cli("ls", str(tmp_path / "run"), "--local-dir", str(tmp_path / "nvme"))[0] == 0


# -- the spellings, generated ----------------------------------------------

_NAMES = ["a", "b", "run"]


@st.composite
def _spelling(draw: st.DrawFn, parts: list[str]) -> tuple[str, str]:
    """A way to write the directory ``parts`` (under the test's base): which
    prefix (absolute, file://, relative to the base, through a symlink to
    the base), and per component noise (``./``, ``x/../``, doubled and
    trailing slashes)."""
    out: list[str] = []
    for part in parts:
        if draw(st.booleans()):
            out.append(".")
        if draw(st.booleans()):
            out += [draw(st.sampled_from(_NAMES)), ".."]
        out.append(part)
    sep = draw(st.sampled_from(["/", "//"]))
    tail = draw(st.sampled_from(["", "/", "/."]))
    return draw(st.sampled_from(["abs", "file", "rel", "link"])), sep.join(out) + tail


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    root=st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3),
    local=st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3),
    data=st.data(),
)
def test_generated_spellings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: list[str], local: list[str], data: st.DataObject
) -> None:
    """Whatever the spellings, refused exactly when one directory is the
    other or holds it (decided here from the plain component lists)."""
    base = tmp_path / "base"
    for first in _NAMES:  # every x/../ detour must exist for the kernel to follow it
        for second in _NAMES:
            for third in _NAMES:
                (base / first / second / third).mkdir(parents=True, exist_ok=True)
    link = tmp_path / "link"
    if not link.exists():
        link.symlink_to(base)
    monkeypatch.chdir(base)

    def spell(how: str, path: str) -> str:
        return {"abs": f"{base}/{path}", "file": f"file://{base}/{path}", "rel": path, "link": f"{link}/{path}"}[how]

    root_uri = spell(*data.draw(_spelling(root)))
    local_uri = spell(*data.draw(_spelling(local)))
    nested = root[: len(local)] == local or local[: len(root)] == root
    if nested:
        _refused(root_uri, local_uri)
    else:
        _tiered(root_uri, local_uri).close()
