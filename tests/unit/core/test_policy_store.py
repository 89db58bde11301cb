"""The policy store's folder contract (core/policy_store.py): names, layouts, and a path the
system refuses to look at (an operator's ``POST /admin/load_policy`` path may be any string;
schemathesis found a 4,000-character one raising ``OSError`` ENAMETOOLONG from ``is_file``)."""

from __future__ import annotations

import pytest

from core.policy_store import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    WEIGHTS_FILE,
    Layout,
    folder_version,
    is_file,
    layout,
    version_dir,
    version_dirs,
)


def test_folder_names(tmp_path):
    assert version_dir(tmp_path, 7) == tmp_path / "v000007"
    assert folder_version(tmp_path / "v000007") == 7
    assert (
        folder_version(tmp_path / "v000007.tmp") is None
        and folder_version(tmp_path / "checkpoint.pt") is None
    )
    with pytest.raises(ValueError, match="a policy version is >= 0, not -1"):
        version_dir(tmp_path, -1)


def test_layouts(tmp_path):
    full, adapter, half, empty = (version_dir(tmp_path, v) for v in (1, 2, 3, 4))
    for d in (full, adapter, half, empty):
        d.mkdir()
    (full / WEIGHTS_FILE).write_bytes(b"")
    (adapter / ADAPTER_FILE).write_bytes(b"")
    (adapter / ADAPTER_CONFIG).write_text("{}")
    (half / ADAPTER_FILE).write_bytes(b"")  # an adapter without its config is no version
    (tmp_path / "v000005.tmp").mkdir()
    assert [layout(d) for d in (full, adapter, half, empty)] == [Layout.FULL, Layout.ADAPTER, None, None]
    assert [v for v, _ in version_dirs(tmp_path)] == [1, 2, 3, 4]


def test_a_path_the_system_refuses_holds_nothing(tmp_path):
    # NAME_MAX is 255 bytes on Linux filesystems: a 4,000-character component is ENAMETOOLONG.
    long = tmp_path / ("0" * 4000)
    with pytest.raises(OSError):
        long.is_file()
    assert is_file(long / WEIGHTS_FILE) is False
    assert layout(long) is None
