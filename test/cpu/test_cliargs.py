"""The shared argparse value types: bad counts and rates stop at parse time with one line."""
import argparse
import lzma

import pytest

from sglang_h20.cliargs import int_at_least, non_negative_int, positive_float, positive_int


def parse(kind, text):
    ap = argparse.ArgumentParser(prog="t", exit_on_error=False)
    ap.add_argument("--x", type=kind)
    return ap.parse_args(["--x", text]).x


@pytest.mark.parametrize("kind,text,value", [(positive_int, "3", 3), (non_negative_int, "0", 0),
                                             (int_at_least(5), "5", 5), (positive_float, "0.25", 0.25)])
def test_accepts(kind, text, value):
    assert parse(kind, text) == value


@pytest.mark.parametrize("kind,text", [(positive_int, "0"), (positive_int, "-2"), (positive_int, "1.5"),
                                       (positive_int, "x"), (non_negative_int, "-1"), (int_at_least(5), "4"),
                                       (positive_float, "0"), (positive_float, "-1"), (positive_float, "nan"),
                                       (positive_float, "inf"), (positive_float, "fast")])
def test_rejects_with_the_value_named(kind, text):
    with pytest.raises(argparse.ArgumentError, match=f"got '{text}'"):
        parse(kind, text)


def test_read_json_and_make_dir_fail_in_one_line_naming_the_input(tmp_path):
    from sglang_h20.cliargs import make_dir, read_json

    good = tmp_path / "r.json"
    good.write_text('{"a": 1}')
    assert read_json(good, "--run") == {"a": 1}
    packed = tmp_path / "r.json.xz"  # large records are stored compressed
    packed.write_bytes(lzma.compress(b'{"a": 2}'))
    assert read_json(packed, "--run") == {"a": 2}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    not_xz = tmp_path / "plain.json.xz"
    not_xz.write_text('{"a": 3}')
    for path in (bad, tmp_path / "missing.json", not_xz):
        with pytest.raises(ValueError, match=f"^--run {path}: cannot read JSON") as e:
            read_json(path, "--run")
        assert "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="^tool: --merge"):
        read_json(bad, "tool: --merge", SystemExit)
    assert make_dir(tmp_path / "a" / "b").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="^--out: cannot create the directory"):
        make_dir(blocker / "sub")
