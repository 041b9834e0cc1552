"""Bad input files and options: one line naming the file (or option), exit code 2, no traceback.

Each case was once a traceback: a truncated or hand-made length-model ``.npz``,
random bytes as a GGUF, a throughput CSV with one workload, in another
encoding, or without a final newline, and a ``--device`` torch cannot use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from duetime.cli import app
from duetime.engine import GGUFFile, ModelFileError
from duetime.predict.ala_data import (
    AlaDataError,
    Measurement,
    append_rows,
    read_csv,
    shipped_dir,
)
from duetime.predict.length_model import MODEL_FORMAT, MODEL_VERSION, LengthModel
from duetime.predict.npz_file import save_npz

runner = CliRunner()
HEADER = {"format": MODEL_FORMAT, "version": MODEL_VERSION}


def _invoke(*args: str) -> tuple[int, str]:
    """Exit code and output as one line of words (click's error box unfolded)."""
    res = runner.invoke(app, list(args))
    return res.exit_code, " ".join(res.output.replace("│", " ").split())


def _truncated_npz(path: Path) -> Path:
    good = save_npz(path.with_name("whole.npz"), HEADER, {"x": np.arange(4000.0)})
    raw = good.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return path


# --- 1. length-model .npz files -----------------------------------------------------------


def test_truncated_model_file_names_the_file(tmp_path: Path) -> None:
    path = _truncated_npz(tmp_path / "trunc.npz")
    with pytest.raises(ValueError, match=r"trunc\.npz: not a duetime length-model file"):
        LengthModel.load(path)


def test_corrupt_member_of_model_file_names_the_file(tmp_path: Path) -> None:
    """Damage inside a member (the directory intact) fails only when the member is read."""
    good = save_npz(tmp_path / "good.npz", HEADER, {"x": np.arange(4000.0)})
    raw = bytearray(good.read_bytes())
    for i in range(200, 1200):
        raw[i] ^= 0x5A
    path = tmp_path / "corrupt.npz"
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"corrupt\.npz: not a duetime length-model file"):
        LengthModel.load(path)


@pytest.mark.parametrize(
    ("header", "problem"),
    [("[1, 2]", "header is a JSON list"), ("{nope", "header is not JSON")],
)
def test_model_file_header_that_is_no_json_object(
    tmp_path: Path, header: str, problem: str
) -> None:
    path = tmp_path / "h.npz"
    np.savez(path, header=np.asarray(header))
    with pytest.raises(
        ValueError, match=rf"h\.npz: not a duetime length-model file \(its {problem}"
    ):
        LengthModel.load(path)


def test_model_file_without_its_arrays_names_what_is_missing(tmp_path: Path) -> None:
    path = save_npz(tmp_path / "empty.npz", HEADER, {})
    with pytest.raises(ValueError, match=r"empty\.npz: length-model file lacks 'conformal_scores'"):
        LengthModel.load(path)
    path = save_npz(tmp_path / "nohead.npz", HEADER, {"conformal_scores": np.zeros(3)})
    with pytest.raises(ValueError, match=r"nohead\.npz: length-model file lacks 'w1'"):
        LengthModel.load(path)


def test_npy_array_named_npz_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "arr.npz"
    with path.open("wb") as f:
        np.save(f, np.zeros(3))
    with pytest.raises(ValueError, match=r"arr\.npz: not a duetime length-model file"):
        LengthModel.load(path)


def test_cli_truncated_model_and_bundle_exit_2(tmp_path: Path) -> None:
    path = _truncated_npz(tmp_path / "trunc.npz")
    code, out = _invoke(
        "sim", "--workload", "synthetic", "--requests", "5", "--predictor", f"learned:{path}"
    )
    assert code == 2, out
    assert "trunc.npz: not a duetime length-model file" in out
    code, out = _invoke("bench", "predict-length", "--model", str(path))
    assert code == 2, out
    assert "trunc.npz: not a duetime length-model file" in out
    code, out = _invoke(
        "predict", "train-length", "--encoder", "minilm-ft", "--bundle", str(path),
        "--out", str(tmp_path / "m.npz"),
    )  # fmt: skip
    assert code == 2, out
    assert "trunc.npz: not a duetime token bundle" in out
    assert not (tmp_path / "m.npz").exists()


# --- 2. GGUF files ------------------------------------------------------------------------


def test_random_bytes_as_gguf_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "rand.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=r"rand\.gguf: not a GGUF file"):
        GGUFFile(path)
    assert issubclass(ModelFileError, ValueError)
    code, out = _invoke("serve", "--model", str(path))
    assert code == 2, out
    assert "rand.gguf: not a GGUF file" in out
    code, out = _invoke("bench", "eviction", "--model", str(tmp_path / "nope"))
    assert code == 2, out
    assert "nope': not 'gemma', 'tiny' or an existing GGUF file" in out  # names the choices
    assert "--model" in out
    code, out = _invoke("bench", "eviction", "--model", str(path))
    assert code == 2, out
    assert "--model " in out
    assert "rand.gguf: not a GGUF file" in out


# --- 3.-5. throughput CSVs ----------------------------------------------------------------


def _shipped_rows(config: str, ii: int, oo: int) -> list[str]:
    lines = (shipped_dir() / "engine-cpu.csv").read_text().splitlines()
    rows = [r for r in lines[1:] if r.split(",")[:4] == [config, "engine", str(ii), str(oo)]]
    assert len(rows) >= 3
    return [lines[0], *rows]


def test_throughput_of_a_config_with_one_workload_says_how_many_are_needed(
    tmp_path: Path,
) -> None:
    config = "engine-gemma3-270m-fp32-t1"
    path = tmp_path / "one.csv"
    path.write_text("\n".join(_shipped_rows(config, 16, 8)) + "\n")
    code, out = _invoke(
        "predict", "throughput", "--input-len", "16", "--output-len", "8", "--batch", "2",
        "--config", config, "--data", str(path),
    )  # fmt: skip
    assert code == 2, out
    assert f"throughput config '{config}': 1 (ii, oo) workload(s)" in out
    assert "needs at least 2" in out


def test_append_after_a_last_row_without_newline_starts_a_new_line(tmp_path: Path) -> None:
    config = "engine-gemma3-270m-fp32-t1"
    path = tmp_path / "edited.csv"
    path.write_text("\n".join(_shipped_rows(config, 16, 8)))  # no final newline
    before = len(read_csv(path))
    append_rows(path, [Measurement(config, "engine", 32, 8, 1, 0, 3.5, 2.25)])
    rows = read_csv(path)
    assert len(rows) == before + 1
    assert rows[-1].ii == 32
    append_rows(path, [Measurement(config, "engine", 32, 8, 2, 0, 3.5, 4.5)])  # ends in \n now
    assert len(read_csv(path)) == before + 2
    assert "\n\n" not in path.read_text()


def test_throughput_csv_of_binary_bytes_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rand.csv"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(AlaDataError, match=r"rand\.csv: not UTF-8 text"):
        read_csv(path)
    code, out = _invoke(
        "predict", "throughput", "--input-len", "16", "--output-len", "8", "--batch", "2",
        "--config", "c1", "--data", str(path),
    )  # fmt: skip
    assert code == 2, out
    assert "rand.csv: not UTF-8 text" in out


# --- 6. --device --------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["nope", "meta", "cuda:99"])
def test_bad_device_is_refused_before_the_data_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    import duetime.predict.length_tokens as tokens

    def no_data(**_: object) -> None:
        raise AssertionError("the data loaded before --device was checked")

    monkeypatch.setattr(tokens, "build_bundle", no_data)
    code, out = _invoke(
        "predict", "train-length", "--encoder", "minilm-ft", "--device", device,
        "--out", str(tmp_path / "m.npz"), "--json", str(tmp_path / "m.json"),
    )  # fmt: skip
    assert code == 2, out
    assert f"--device '{device}'" in out
    assert not (tmp_path / "m.npz").exists()
    assert not (tmp_path / "m.json").exists()
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--device", "cuda"), "--device cuda moves a fine-tuned encoder only"),
        (("--max-len", "10"), "max_len (--max-len) must be >= bucket_size (--bucket-size) 16"),
        (("--readout", "foo"), "readout (--readout) must be one of argmax, median, mean"),
    ],
)
def test_a_frozen_encoders_training_names_what_it_refuses(
    tmp_path: Path, args: tuple[str, str], named: str
) -> None:
    """--device was ignored in silence; --max-len 10 printed the whole RLPConfig."""
    code, out = _invoke("predict", "train-length", *args, "--out", str(tmp_path / "m.npz"))
    assert code == 2, out
    assert named in out
    assert "RLPConfig(" not in out
    assert not (tmp_path / "m.npz").exists()


def test_the_checkpoint_beside_out_is_spoken_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume with no checkpoint, and a checkpoint a new run writes over, went unsaid."""
    from duetime.cli.predict_train import say_checkpoint

    ckpt = tmp_path / "m.npz.ckpt"
    say_checkpoint(ckpt, resume=True)
    assert "no checkpoint at" in " ".join(capsys.readouterr().err.split())
    ckpt.write_bytes(b"x")
    say_checkpoint(ckpt, resume=False)
    assert "holds an interrupted training" in " ".join(capsys.readouterr().err.split())
    say_checkpoint(ckpt, resume=True)
    assert capsys.readouterr().err == ""
