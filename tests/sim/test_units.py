"""Byte sizes: "50GB" is 50 * 10**9 bytes, "12GiB" is 12 * 2**30."""

from __future__ import annotations

import pytest
from kvfrag.sim.units import MAX_SIZE, check_size, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("50GB", 50 * 10**9),
        ("12GiB", 12 * 2**30),
        ("800 KiB", 800 * 1024),
        ("128KiB", 131072),
        ("1TB", 10**12),
        ("2TiB", 2 * 2**40),
        ("3MB", 3 * 10**6),
        ("5MiB", 5 * 2**20),
        ("7KB", 7000),
        ("4096", 4096),
        ("4096B", 4096),
        ("0", 0),
        ("  50 gb  ", 50 * 10**9),
        ("12gib", 12 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("0.5MB", 500_000),
        ("2.25KiB", 2304),
        ("1_000_000", 10**6),
        ("1,000KB", 10**6),
    ],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes
    assert isinstance(parse_size(text), int)


def test_decimal_vs_binary_matters():
    assert parse_size("50GB") // 2**30 == 46
    assert parse_size("50GiB") // 2**30 == 50


@pytest.mark.parametrize("value", [0, 1, 4096, 50 * 10**9])
def test_ints_pass_through(value):
    assert parse_size(value) == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("50XB", "unknown unit 'XB'"),
        ("12GiBs", "unknown unit 'GiBs'"),
        ("10 bytes", "unknown unit 'bytes'"),
        ("-5GB", "is not a size"),
        ("GB", "is not a size"),
        ("", "is not a size"),
        ("1.2.3GB", "is not a size"),
        ("5 G B", "is not a size"),
        (-1, "size -1 is negative"),
        ("0.5B", "not a whole number of bytes"),
        ("1.0001KB", "not a whole number of bytes"),
        ("0.1KiB", "not a whole number of bytes"),
        (True, "is not a size"),
        (1.5, "is not a size"),
        (None, "is not a size"),
    ],
)
def test_parse_size_errors(value, message):
    with pytest.raises(ValueError, match=message):
        parse_size(value)


def test_unknown_unit_lists_valid_units():
    with pytest.raises(ValueError) as err:
        parse_size("3 PB")
    assert "valid: B, KB, MB, GB, TB, KIB, MIB, GIB, TIB" in str(err.value)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (131072, "128.0 KiB"),
        (12 * 2**30, "12.0 GiB"),
        (3 * 2**40, "3.0 TiB"),
        (parse_size("50GB"), "46.6 GiB"),
    ],
)
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_parse_size_refuses_non_finite_numbers(value):
    with pytest.raises(ValueError, match=r"is not a finite number"):
        parse_size(value)


def test_check_size_names_the_size_and_the_limit():
    assert check_size(MAX_SIZE, "kv_budget") == 2**50
    with pytest.raises(
        ValueError, match=r"^kv_budget 86\.7 EiB is larger than kvfrag models \(at most 1\.0 PiB\)$"
    ):
        check_size(10**20, "kv_budget")
    with pytest.raises(ValueError, match=r"^weights about 2\*\*3321 B is larger"):
        check_size(10**1000, "weights")


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(2**50, "1.0 PiB"), (3 * 2**60, "3.0 EiB"), (10**20, "86.7 EiB"),
     (2**1000, "about 2**1000 B")],
)
def test_format_size_of_huge_sizes(nbytes, text):
    assert format_size(nbytes) == text
