"""The hybrid strategy beyond the lecture's case: choice, placement, what would fit."""

import pytest

from lessmem.plan import get_hardware, get_kv, get_model, plan
from lessmem.plan.hybrid import resident_tokens


def _h(**kw):
    return plan("llama-3-8b", **kw)["hybrid"]


def test_chooses_the_most_precise_that_fits():
    h = _h(context=4096, batch=4, kv="fp16,fp8,int4", kv_budget="4GiB")  # fp16 needs 2 GiB
    assert h["chosen"] == "fp16" and all(r["fits_entirely"] for r in h["rows"])
    h = _h(context=4096, batch=16, kv="fp16,fp8,int4", kv_budget="4GiB")  # fp8 needs 4 GiB
    assert h["chosen"] == "fp8" and not h["rows"][0]["fits_entirely"]


def test_lossy_only_when_nothing_near_lossless_asked():
    assert _h(context=16384, batch=16, kv="fp16,int4", kv_budget="4GiB")["chosen"] == "int4"


def test_host_ram_full_spills_to_nvme():
    h = _h(context=16384, batch=16, kv="fp16", kv_budget="4GiB", host_ram="16GiB")
    r = h["rows"][0]
    assert [t["tier"] for t in r["placement"]] == ["host", "nvme"]
    assert r["placement"][0]["bytes"] == 16 * 2**30 and r["offload_tier"] == "nvme"
    assert sum(t["bytes"] for t in r["placement"]) == r["offloaded_bytes_total"] == 28 * 2**30
    assert r["link_bandwidth"] == 5e9


def test_cpu_offloads_to_nvme():
    p = plan("smollm2-135m", hardware="laptop-cpu", context=8192, batch=8, kv="fp16", kv_budget="128MiB")
    r = p["hybrid"]["rows"][0]
    assert r["offload_tier"] == "nvme" and r["link_bandwidth"] == 3e9


def test_resident_tokens_is_the_largest_that_fits():
    m = get_model("smollm2-135m")
    for name in ("fp16", "kivi-4", "best-2"):
        p = get_kv(name)
        from lessmem.plan import kv_bytes

        budget = 5_000_000
        n = resident_tokens(m, 8192, p, budget)
        assert kv_bytes(m, n, 1, p)["total"] <= budget < kv_bytes(m, n + 1, 1, p)["total"] or n == 8192


def test_full_attention_transfer_bound_and_faster_link():
    slow = _h(context=16384, batch=16, kv="fp16", kv_budget="4GiB")["rows"][0]["full"]
    fast = _h(context=16384, batch=16, kv="fp16", kv_budget="4GiB", pcie_gen=5)["rows"][0]["full"]
    assert not slow["meets_target"] and fast["max_tok_s"] == pytest.approx(2 * slow["max_tok_s"], rel=0.05)
    assert get_hardware("generic-gpu", pcie_gen=5).pcie_bw == 50e9


def test_target_rate_validation():
    with pytest.raises(ValueError, match=r"target_tps=0 must be positive"):
        plan("llama-3-8b", target_tps=0)
    with pytest.raises(ValueError, match=r"batch=0 must be >= 1"):
        plan("llama-3-8b", batch=0)


def test_params_override_spellings():
    from lessmem.plan.planner import parse_params

    assert [parse_params(x) for x in (8e9, "8e9", "8B", "134.5M", "70b")] == [8e9, 8e9, 8e9, 134.5e6, 70e9]
    with pytest.raises(ValueError, match=r"params='lots' is not a parameter count; use e.g. 8e9"):
        parse_params("lots")
    with pytest.raises(ValueError, match=r"params=0 must be positive"):
        plan("llama-3-8b", params=0)
