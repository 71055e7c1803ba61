import os
import subprocess
import sys

import pytest

from lessmem.formats import PerGroup
from lessmem.offload.hashing import layer_key, namespace, prefix_hashes, sequence_hash

CFG = {"keys": {"bits": 4, "granularity": PerGroup(32, axis=-2)}, "window": 128}


def test_chain_depends_on_whole_prefix():
    a = prefix_hashes(list(range(40)), 8, "m", CFG)
    b = prefix_hashes([99] + list(range(1, 40)), 8, "m", CFG)
    c = prefix_hashes(list(range(32)) + [7] * 8, 8, "m", CFG)
    assert len(a) == 5 and len(set(a)) == 5
    assert all(x != y for x, y in zip(a, b, strict=True))  # first token differs -> every key differs
    assert a[:4] == c[:4] and a[4] != c[4]  # shared prefix -> shared keys


def test_model_and_config_change_keys():
    base = prefix_hashes(range(16), 8, "m", CFG)
    assert prefix_hashes(range(16), 8, "other", CFG) != base
    assert prefix_hashes(range(16), 8, "m", {**CFG, "window": 64}) != base
    assert prefix_hashes(range(16), 8, "m", dict(reversed(list(CFG.items())))) == base


def test_same_keys_in_other_processes():
    code = ("from lessmem.offload.hashing import prefix_hashes;"
            "from lessmem.formats import PerGroup;"
            "print(prefix_hashes(range(24), 8, 'm', {'keys': {'bits': 4, 'granularity': "
            "PerGroup(32, axis=-2)}, 'window': 128})[-1])")
    # another process with another str-hash salt than this one computes the same key
    env = {**os.environ, "PYTHONHASHSEED": str(hash("salt") % 1000 + 1)}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert other == prefix_hashes(range(24), 8, "m", CFG)[-1]


def test_layer_key_and_errors():
    h = prefix_hashes(range(8), 8, "m")[0]
    assert layer_key(h, 7) == f"{h}-L07" and len(h) == 64
    with pytest.raises(ValueError, match="block_tokens=0"):
        prefix_hashes(range(8), 0, "m")
    with pytest.raises(ValueError, match="model_id"):
        namespace("", {})
    with pytest.raises(ValueError, match="cannot be hashed"):
        namespace("m", {"x": object()})
    with pytest.raises(ValueError, match="layer=-1"):
        layer_key(h, -1)


def test_first_block_and_sequence_hash():
    hs = prefix_hashes(range(20), 8, "m", CFG, first_block=4)
    assert len(hs) == 3  # [0,4), [4,12), [12,20)
    assert prefix_hashes(range(19), 8, "m", CFG, first_block=4) == hs[:2]
    assert prefix_hashes(range(3), 8, "m", CFG, first_block=4) == []
    assert sequence_hash(range(5), "m", CFG) != sequence_hash(range(6), "m", CFG)
    assert sequence_hash(range(5), "m", CFG) == sequence_hash(list(range(5)), "m", CFG)
    with pytest.raises(ValueError, match="first_block=-1"):
        prefix_hashes(range(8), 8, "m", first_block=-1)
