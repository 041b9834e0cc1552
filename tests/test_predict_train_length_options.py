"""`duetime predict train-length`: numbers typer lets through are refused before any data
loads (before, ``--coverage 1.5`` failed only after the whole training and a NaN or
negative learning rate was accepted)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

runner = CliRunner()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--coverage", "1.5"),
        ("--coverage", "0"),
        ("--coverage", "nan"),
        ("--lr", "nan"),
        ("--lr", "-1"),
        ("--lr", "0"),
        ("--encoder-lr", "nan"),
        ("--encoder-lr", "-0.001"),
        ("--encoder-lr", "inf"),
        ("--dropout", "nan"),
        ("--label-sigma", "nan"),
    ],
)
@pytest.mark.parametrize("encoder", ["minilm-static:16", "minilm-ft:16:1"])
def test_bad_number_is_refused_before_the_data_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str, value: str, encoder: str
) -> None:
    import duetime.predict.length_features as features
    import duetime.predict.length_tokens as tokens
    from duetime.cli import app

    def no_data(*_: object, **__: object) -> None:
        raise AssertionError(f"the data loaded before {option} was checked")

    monkeypatch.setattr(tokens, "build_bundle", no_data)  # minilm-ft
    monkeypatch.setattr(features, "make_encoder", no_data)  # frozen encoders
    res = runner.invoke(
        app,
        ["predict", "train-length", "--encoder", encoder, option, value,
         "--out", str(tmp_path / "m.npz")],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit)  # no traceback, no training
    assert option in res.output
    assert not (tmp_path / "m.npz").exists()
