"""Unit parsing and printing: GiB vs GB never confused."""

import pytest

from lessmem.base.units import fmt_bytes, fmt_rate, fmt_time, parse_bytes, parse_count, parse_rate


@pytest.mark.parametrize("text,value", [
    ("4GiB", 4 * 2**30), ("4 GiB", 4 * 2**30), ("4GB", 4_000_000_000), ("512MiB", 512 * 2**20),
    ("1.5KiB", 1536), ("1e9", 10**9), ("100", 100), (4096, 4096), ("2TiB", 2 * 2**40), ("7b", 7),
    # one rule: KB decimal, KiB binary, a bare K/M/G/T binary (like free and docker)
    ("2G", 2 * 2**30), ("2g", 2 * 2**30), ("2Gi", 2 * 2**30), ("64M", 64 * 2**20), ("16k", 16384),
    ("1T", 2**40), ("2GB", 2_000_000_000), ("2gb", 2_000_000_000), ("3KB", 3000), ("3 kB", 3000),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text,value", [
    ("25GB/s", 25e9), ("3.35TB/s", 3.35e12), ("1600KiB/s", 1_638_400), ("5 GB/s", 5e9), ("100GBps", 100e9),
])
def test_parse_rate(text, value):
    assert parse_rate(text) == pytest.approx(value)


def test_parse_count_16k_is_16384():
    assert parse_count("16k") == 16384 and parse_count("16,384") == 16384 and parse_count("1m") == 2**20


@pytest.mark.parametrize("fn,text,match", [
    (parse_bytes, "lots", r"size='lots' is not a size; use a number with an optional unit"),
    (parse_bytes, "-4GiB", "must not be negative"),
    (parse_bytes, "4iB", "'i' needs a prefix"),
    (parse_bytes, "4 parsecs", r"allowed units: B, KB/MB/GB/TB \(1000-based\), KiB/MiB/GiB/TiB"),
    (parse_bytes, True, "size=True is not a size"),
    (parse_rate, "0GB/s", "must be positive"),
    (parse_rate, "fast", "is not a size"),
    (parse_count, "12.5", "is not a whole number"),
    (parse_count, "many", "is not a whole number"),
])
def test_parse_errors(fn, text, match):
    with pytest.raises(ValueError, match=match):
        fn(text)


def test_formatting_shows_both_units():
    assert fmt_bytes(4 * 2**30) == "4.00 GiB (4.29 GB)"
    assert fmt_bytes(768 * 2**20, both=False) == "768.00 MiB"
    assert fmt_bytes(100) == "100 B"
    assert fmt_rate(25e9) == "25 GB/s (23.28 GiB/s)"
    assert [fmt_time(s) for s in (0.0028633, 0.1717987, 0.8589935, 2.5, 4e-5)] == [
        "2.86 ms", "171.8 ms", "859.0 ms", "2.5 s", "40.0 µs"]
