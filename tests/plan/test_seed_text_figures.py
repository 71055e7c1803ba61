"""Every figure of the two source texts the project started from (../shared/docs/seeds/), one test each.

Conventions where the texts round: KiB/MiB/GiB are powers of 1024 and GB/s powers of
1000 (the texts' own notation section); "16K context" is 16,384 tokens; times are
compared at the precision the text prints them (2.86 ms, 171.8 ms, 859.0 ms); "an 8B
model" is exactly 8e9 parameters where the text computes from it (16 GB), and the
llama-3-8b preset (8.03e9) must round to the same printed figure.
"""

import pytest

from lessmem.base.units import GiB, KiB, MiB
from lessmem.plan import get_hardware, get_model, get_weight_format, plan, weight_footprint

LLAMA = dict(context=16384, batch=16, kv="fp16,fp8,int4", kv_budget="4GiB")


@pytest.fixture(scope="module")
def ex3():
    return plan("llama-3-8b", **LLAMA)


def _row(rows, name):
    return next(r for r in rows if r["precision"] == name)


# --- 000: Use Less Memory — exercise 3, part A ------------------------------------

def test_llama3_8b_dims_give_65536_b_bytes_per_token():
    m = get_model("llama-3-8b")
    assert (m.layers, m.kv_heads, m.head_dim) == (32, 8, 128)
    assert m.kv_elements_per_token == 65_536


def test_bytes_per_token_128_64_32_kib(ex3):
    assert [r["per_token"] for r in ex3["kv"]] == [128 * KiB, 64 * KiB, 32 * KiB]
    assert _row(ex3["kv"], "fp16")["per_token"] == 131_072


def test_fp8_and_int8_both_64_kib():
    p = plan("llama-3-8b", context=1, kv="fp8,int8")
    assert [r["per_token"] for r in p["kv"]] == [64 * KiB, 64 * KiB]


def test_per_request_at_16k_2_1_half_gib(ex3):
    assert [r["per_request"] / GiB for r in ex3["kv"]] == [2.0, 1.0, 0.5]


def test_sixteen_requests_32_16_8_gib(ex3):
    assert [r["total"] / GiB for r in ex3["kv"]] == [32.0, 16.0, 8.0]


def test_bytes_per_element_and_compression_table():
    # section 2.4 / 6: bytes/elem 2, 1, 1, 0.5; compression 1x, 2x, 2x, 4x; VRAM needed 100/50/50/25%
    p = plan("llama-3-8b", context=1024, kv="fp16,fp8,int8,int4")
    assert [r["per_token_bytes_raw"] / 65_536 for r in p["kv"]] == [2, 1, 1, 0.5]
    assert [r["compression_vs_fp16"] for r in p["kv"]] == [1, 2, 2, 4]
    assert [r["fraction_of_fp16"] for r in p["kv"]] == [1, 0.5, 0.5, 0.25]


# --- 000: exercise 2, three tiers -------------------------------------------------

def test_4gib_is_4_295_gb(ex3):
    assert ex3["transfer"]["bytes"] == 4_294_967_296
    assert round(ex3["transfer"]["bytes"] / 1e9, 3) == 4.295


def test_hbm_2_86_ms(ex3):
    hbm = ex3["transfer"]["tiers"][0]
    assert hbm["bandwidth"] == 1500e9 and round(hbm["seconds"] * 1e3, 2) == 2.86


def test_pcie_gen4_x16_171_8_ms(ex3):
    host = ex3["transfer"]["tiers"][1]
    assert host["bandwidth"] == 25e9 and round(host["seconds"] * 1e3, 1) == 171.8


def test_nvme_859_0_ms(ex3):
    nvme = ex3["transfer"]["tiers"][2]
    assert nvme["bandwidth"] == 5e9 and round(nvme["seconds"] * 1e3, 1) == 859.0


def test_ratios_60x_and_300x(ex3):
    assert [round(t["ratio_vs_device"]) for t in ex3["transfer"]["tiers"]] == [1, 60, 300]


def test_pcie_theoretical_31_5_sustained_25():
    hw = get_hardware("generic-gpu")
    assert round(hw.pcie_bw_theoretical / 1e9, 1) == 31.5 and hw.pcie_bw == 25e9


def test_step_budget_40_ms_exceeded_4x(ex3):
    # "At 25 tokens/s ... each step has 40 ms budget. PCIe transfer of 4 GiB exceeds the budget by 4x."
    assert ex3["transfer"]["step_budget_s"] == pytest.approx(0.040)
    assert int(ex3["transfer"]["tiers"][1]["x_step_budget"]) == 4


def test_hbm_capacities_of_the_tier_table():
    caps = {n: get_hardware(n).hbm_capacity / GiB for n in ("h100", "h200", "mi300x")}
    assert caps == {"h100": 80, "h200": 141, "mi300x": 192}


# --- 000: exercise 3, parts B and C -----------------------------------------------

def test_fp8_is_chosen(ex3):
    assert ex3["hybrid"]["chosen"] == "fp8"


def test_65536_tokens_resident_4096_per_request(ex3):
    r = _row(ex3["hybrid"]["rows"], "fp8")
    assert r["resident_tokens_total"] == 65_536 and r["resident_tokens_per_request"] == 4_096
    assert r["resident_fraction"] == 0.25


def test_12288_offloaded_768_mib_each_12_gib_to_host(ex3):
    r = _row(ex3["hybrid"]["rows"], "fp8")
    assert r["offloaded_tokens_per_request"] == 12_288
    assert r["offloaded_bytes_per_request"] == 768 * MiB
    assert r["offloaded_bytes_total"] == 12 * GiB and r["offload_tier"] == "host"
    assert r["offloaded_tokens_per_request"] / 16384 == 0.75


def test_per_request_rate_1_56_and_0_64_s(ex3):
    r = _row(ex3["hybrid"]["rows"], "fp8")
    assert r["tok_s_per_request"] == pytest.approx(1.5625) and r["seconds_per_token_per_request"] == 0.64


def test_2_kib_per_token_per_layer(ex3):
    assert _row(ex3["hybrid"]["rows"], "fp8")["bytes_per_token_per_layer"] == 2 * KiB


def test_streaming_1600_kib_s_1_5625_mib_s_0_0016_gb_s(ex3):
    d = _row(ex3["hybrid"]["rows"], "fp8")["sliding"]["demand_bytes_per_s"]
    assert d == 64 * KiB * 25
    assert d / KiB == 1600 and d / MiB == 1.5625 and round(d / 1e9, 4) == 0.0016


def test_under_0_1_percent_of_link_and_hidden(ex3):
    s = _row(ex3["hybrid"]["rows"], "fp8")["sliding"]
    assert s["link_fraction"] < 0.001 and s["prefetch_hidden"]


def test_quantization_halves_32_to_16_gib(ex3):
    assert _row(ex3["hybrid"]["rows"], "fp16")["kv_total"] == 32 * GiB
    assert _row(ex3["hybrid"]["rows"], "fp8")["kv_total"] == 16 * GiB


# --- 004: Quantization ------------------------------------------------------------

def test_8b_fp16_is_16_gb():
    assert weight_footprint(get_model("llama-3-8b").with_params(8e9), "fp16")["bytes"] == 16e9


def test_8b_fp16_at_3_35_tb_s_4_8_ms_209_tok_s():
    for params in (8e9, None):  # the text's round 8B and the real 8.03B both print ~4.8 ms, ~209 tok/s
        d = plan("llama-3-8b", hardware="h100", params=params, context=1, kv="fp16")["decode"][0]
        assert d["bandwidth"] == 3.35e12
        assert round(d["seconds_per_token"] * 1e3, 1) == 4.8 and round(d["tok_s"]) in (209,)
    d = plan("llama-3-8b", hardware="h100", params=8e9, context=1, kv="fp16")["decode"][0]
    assert round(d["seconds_per_token"] * 1e3, 2) == 4.78  # the simulator's "4.78 ms/token"


def test_8b_fp16_at_3_3_tb_s_about_5_ms():
    d = plan("llama-3-8b", params=8e9, hbm_bw="3.3TB/s", context=1, kv="fp16")["decode"][0]
    assert round(d["seconds_per_token"] * 1e3) == 5


def test_laptop_100_gb_s_160_ms_six_tok_s():
    d = plan("llama-3-8b", hardware="laptop-cpu", params=8e9, context=1, kv="fp16")["decode"][0]
    assert d["seconds_per_token"] == pytest.approx(0.160) and int(d["tok_s"]) == 6


def test_int4_group32_is_4_5_bits_11_1_percent():
    f = get_weight_format("int4-g32")
    assert f.bits_per_weight == 4.5 and round(100 * f.scale_share, 1) == 11.1


def test_8b_int4_g32_weights_4_2_gib():
    w = weight_footprint(get_model("llama-3-8b").with_params(8e9), "int4-g32")
    assert round(w["bytes"] / 1e9, 2) == 4.50 and round(w["bytes"] / GiB, 1) == 4.2  # norms stay fp16
    assert round(weight_footprint(get_model("llama-3-8b"), "int4-g32")["bytes"] / GiB, 1) == 4.2


def test_int4_g32_decode_and_the_texts_gib_gb_mixup():
    # The simulator prints 1.25 ms / 799 tok/s for 4-bit g32 on an H100. 4.5e9 bytes at
    # 3.35 TB/s is 1.343 ms (744 tok/s); 1.25 ms is what 4.19 (the GiB figure) read as GB
    # gives. The planner reports the consistent figure; the test pins both.
    d = plan("llama-3-8b", hardware="h100", params=8e9, weights="int4-g32", context=1, kv="fp16")["decode"][0]
    assert round(d["seconds_per_token"] * 1e3, 2) == 1.34 and round(d["tok_s"]) == 744
    assert round(4.5e9 / GiB * 1e9 / 3.35e12 * 1e3, 2) == 1.25
    # the speedup is the compression ratio: 16 / 4.5 = 3.56x (the simulator's "compression")
    fp16 = plan("llama-3-8b", hardware="h100", params=8e9, context=1, kv="fp16")["decode"][0]
    assert round(fp16["seconds_per_token"] / d["seconds_per_token"], 2) == round(16 / 4.5, 2) == 3.56


def test_q4_k_m_about_4_8_bpw():
    # llama.cpp's Q4_K_M rules: Q6_K for attn_v and ffn_down of half the layers and the output
    for name in ("llama-2-7b", "mistral-7b", "llama-3-70b"):
        assert round(weight_footprint(get_model(name), "Q4_K_M")["model_bpw"], 1) == 4.8
    # llama.cpp's own quantize table: 7B Q4_K_M = 3.80 GiB
    assert round(weight_footprint(get_model("llama-2-7b"), "q4_k_m")["bytes"] / GiB, 2) == 3.80


def test_group_8_adds_2_bits_a_50_percent_tax():
    f = get_weight_format("int4-g8")
    assert f.bits_per_weight - f.bits == 2 and f.scale_tax == 0.5


def test_two_to_four_times_smaller():
    m = get_model("llama-3-8b")
    fp16 = weight_footprint(m, "fp16")["bytes"]
    assert 1.9 < fp16 / weight_footprint(m, "int8")["bytes"] < 2.0
    assert 3.5 < fp16 / weight_footprint(m, "int4-g32")["bytes"] < 4.0


def test_simulator_memory_panel_fits_in_24_gb():
    # "weights: 4.2 GB, KV (unquantized): 16.0 GB, fits in 24 GB? yes" — the KV is 16 GiB of fp16
    # at 128K tokens (131,072 x 128 KiB); weights 4.2 GiB; both are GiB, shown beside GB.
    p = plan("llama-3-8b", hardware="rtx-4090", weights="int4-g32", context=131072, kv="fp16")
    assert p["kv"][0]["total"] == 16 * GiB
    assert round(p["weights"][0]["bytes"] / GiB, 1) == 4.2
    assert p["fits"][0]["fits"] and p["hardware"]["hbm_capacity"] == 24 * GiB
