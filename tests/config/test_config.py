"""Config loading: defaults and shipped recipes validate, overrides apply, every problem is reported in one error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from sigmanens_dist.config import RECIPES as PACKAGED
from sigmanens_dist.config import (
    Config,
    ConfigError,
    TrainConfig,
    check_paths,
    config_from_dict,
    flatten,
    load_config,
    recipe_path,
    save_config,
)
from sigmanens_dist.data.idx import FASHION_MNIST_ROOT

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs").glob("*.yaml"))


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _problem_paths(err: ConfigError) -> list[str]:
    return [re.match(r"  - (\S+): ", line).group(1) for line in err.problems]


def test_defaults_are_valid() -> None:
    cfg = load_config(None, check_data=False)
    assert cfg == Config()
    assert (cfg.model.name, cfg.model.num_members, cfg.model.method) == ("resnet18", 4, "sigma")
    assert (cfg.reg.tau, cfg.reg.lam) == (0.5, 0.01)
    assert (cfg.train.epochs, cfg.train.max_steps) == (1, None)
    assert cfg.run_dir == Path("runs/default") and cfg.optim.betas == (0.9, 0.999)
    assert cfg.data_root() == FASHION_MNIST_ROOT
    assert load_config(None, ["data.dataset=synthetic"]).data_root() is None


def test_all_six_recipes_exist_once_and_a_checkout_reads_them_from_configs() -> None:
    assert [p.name for p in RECIPES] == ["cifar100_wrn.yaml", "demo.yaml", "fmnist_small.yaml",
                                         "imagenet_resnet50.yaml", "imagenet_vit.yaml", "sst2_bert.yaml"]
    # no copy inside the package: a wheel gets one at build time (tests/test_packaging.py)
    assert PACKAGED == REPO / "configs"
    assert not (REPO / "sigmanens_dist" / "configs").exists()


def test_config_by_recipe_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    assert recipe_path("demo") == recipe_path("demo.yaml") == PACKAGED / "demo.yaml"
    assert load_config("fmnist_small", check_data=False).model.name == "test_resnet"
    (tmp_path / "demo.yaml").write_text("seed: 7\n")  # a file of that name wins
    assert load_config("demo.yaml", check_data=False).seed == 7
    with pytest.raises(ConfigError, match=r"cannot read the config file.*packaged recipe: cifar100_wrn, demo, "):
        load_config("nope", check_data=False)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_without_data(recipe: Path) -> None:
    cfg = load_config(recipe, check_data=False)
    assert cfg.model.num_members == 4
    assert (cfg.train.epochs is None) != (cfg.train.max_steps is None)
    assert cfg.run_dir == Path("runs") / recipe.stem


def test_recipe_values_are_read_as_written() -> None:
    demo = load_config(REPO / "configs" / "demo.yaml", check_data=False)
    assert (demo.model.name, demo.train.max_steps, demo.train.epochs, demo.data.train_subset) == (
        "resnet10t", 300, None, 12000)
    vit = load_config(REPO / "configs" / "imagenet_vit.yaml", check_data=False)
    assert vit.optim.lr == 5e-4 and vit.optim.betas == (0.9, 0.999) and vit.train.ema_decay == 0.99996
    assert (vit.train.amp, vit.data.format, vit.data.root, vit.strategy.backend) == (
        "bf16", "ffcv", Path("/data/imagenet_ffcv"), "nccl")
    assert vit.train.randaugment == "rand-m9-mstd0.5-inc1" and vit.schedule.warmup_steps == 6205
    sst2 = load_config(REPO / "configs" / "sst2_bert.yaml", check_data=False)
    assert (sst2.model.source, sst2.model.name, sst2.model.pretrained, sst2.data.dataset) == (
        "hf", "bert", False, "sst2")
    assert (sst2.optim.name, sst2.optim.lr, sst2.train.amp, sst2.data.tokenizer) == ("adamw", 1e-4, "none", None)
    assert sst2.model.kwargs["num_hidden_layers"] == 2 and sst2.data.max_length == 64


def test_recipe_with_absent_data_fails_with_the_path() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "imagenet_vit.yaml")
    assert _problem_paths(info.value) == ["data.root"]
    assert "/data/imagenet_ffcv does not exist" in str(info.value)


def test_overrides_apply() -> None:
    cfg = load_config(REPO / "configs" / "demo.yaml", ["model.num_members=8", "reg.tau=0.25",
                                                       "model.kwargs.img_size=32", "reg.lambda=0.01",
                                                       "model.layers=[layer1.*, fc]", "tracking.run_name=null",
                                                       "run_dir=/tmp/x"], check_data=False)
    assert cfg.model.num_members == 8 and cfg.reg.tau == 0.25 and cfg.reg.lam == 0.01
    assert cfg.model.kwargs == {"img_size": 32}
    assert cfg.model.layers == ["layer1.*", "fc"] and cfg.tracking.run_name is None
    assert cfg.run_dir == Path("/tmp/x")
    assert cfg.train.max_steps == 300  # untouched values stay as the recipe set them


def test_override_replaces_the_other_spelling_and_the_other_budget(tmp_path: Path) -> None:
    path = _write(tmp_path, "reg:\n  lam: 0.5\ntrain:\n  epochs: 200\n")
    cfg = load_config(path, ["reg.lambda=0.25", "train.max_steps=10"], check_data=False)
    assert cfg.reg.lam == 0.25
    assert (cfg.train.epochs, cfg.train.max_steps) == (None, 10)


def test_every_problem_is_reported_in_one_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  num_members: 0\n  nmembers: 3\nreg:\n  tau: -1\ntrain:\n  batch_size: big\n"
                            "bogus_section: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["optim.lr=0", "noequals", "nosuch.key=1"], check_data=False)
    err, message = info.value, str(info.value)
    assert isinstance(err, ValueError)
    assert message.startswith(f"{path}: 8 problems in the config:\n")
    assert sorted(_problem_paths(err)) == sorted(["model.num_members", "model.nmembers", "reg.tau",
                                                  "train.batch_size", "bogus_section", "optim.lr", "noequals",
                                                  "nosuch.key"])
    assert "  - model.num_members: must be >= 1 (got 0)" in err.problems
    assert "  - reg.tau: must be > 0.0 (got -1)" in err.problems
    assert "  - train.batch_size: must be an integer, not a string (got 'big')" in err.problems
    assert "  - model.nmembers: unknown key (did you mean 'num_members'?) (got 3)" in err.problems
    assert "errors.pydantic.dev" not in message and "Input should" not in message


def test_unknown_override_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["modle.num_members=8"], check_data=False)
    assert _problem_paths(info.value) == ["modle.num_members"]
    assert "unknown top-level key 'modle' (did you mean 'model'?)" in str(info.value)
    with pytest.raises(ConfigError, match=r"  - model\.num_members8: an override must look like dotted\.key=value"):
        load_config(None, ["model.num_members8"], check_data=False)
    with pytest.raises(ConfigError, match=r"  - model\.name\.x: model\.name is not a mapping"):
        load_config(_write(tmp_path, "model:\n  name: resnet18\n"), ["model.name.x=1"], check_data=False)


def test_a_boolean_or_a_string_is_never_a_number(tmp_path: Path) -> None:
    """Pydantic's lax mode read ``true`` (YAML's ``yes`` too) as 1 and ``"4"`` as 4: each is now refused by name."""
    path = _write(tmp_path, 'model:\n  num_members: "4"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, ["model.num_members=true", "reg.tau=yes", "train.max_steps=on", "optim.betas=[0.9, no]",
                           "optim.sigma_lr_scale=x", "eval.severities=[true]", "train.batch_size='8'"],
                    check_data=False)
    boolean = "not a boolean (YAML reads yes/no and on/off as true/false)"
    assert info.value.problems == [
        f"  - model.num_members: must be an integer, {boolean} (got True)",
        f"  - reg.tau: must be a number, {boolean} (got True)",
        f"  - optim.betas[1]: must be a number, {boolean} (got False)",
        "  - optim.sigma_lr_scale: must be a number, not a string, or 'num_members' (got 'x')",
        f"  - train.max_steps: must be an integer, {boolean} (got True)",
        "  - train.batch_size: must be an integer, not a string (got '8')",
        f"  - eval.severities[0]: must be an integer, {boolean} (got True)"]
    with pytest.raises(ConfigError, match=r"model\.num_members: must be an integer, not a string \(got '4'\)"):
        load_config(path, check_data=False)
    # Real numbers still read: an int where a float goes, a whole float (1e4) where an int goes, YAML's 1e-3.
    cfg = load_config(None, ["reg.tau=0.5", "reg.lambda=1", "train.max_steps=1e4", "optim.lr=1e-3",
                             "model.num_members=8", "optim.sigma_lr_scale=2"], check_data=False)
    assert (cfg.reg.tau, cfg.reg.lam, cfg.train.max_steps, cfg.optim.lr) == (0.5, 1.0, 10000, 1e-3)
    assert (cfg.model.num_members, cfg.optim.sigma_lr_scale) == (8, 2.0)
    assert isinstance(cfg.reg.lam, float) and isinstance(cfg.train.max_steps, int)


def _number_keys() -> list[str]:
    """Every key of the schema whose value is a number (or may be), as an override writes it."""

    def numeric(prop: dict) -> bool:
        return any(p.get("type") in ("integer", "number") for p in prop.get("anyOf", [prop]))

    keys = [name for name, prop in Config.model_json_schema()["properties"].items() if numeric(prop)]
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            props = field.annotation.model_json_schema()["properties"]
            keys += [f"{name}.{key}" for key, prop in props.items() if numeric(prop)]
    return keys


def test_no_number_field_takes_a_boolean() -> None:
    """Every number field of every section, present and future: a plain ``int`` or ``float`` annotation would be
    lax again (use the schema's ``Int`` and ``Float``)."""
    keys = _number_keys()
    assert {"seed", "model.num_members", "reg.lambda", "strategy.zero_stage", "data.val_split"} <= set(keys)
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}=true" for key in keys], check_data=False)
    assert sorted(_problem_paths(info.value)) == sorted(keys)
    assert all(line.endswith("(got True)") for line in info.value.problems)


@pytest.mark.parametrize("url", ["http://example.com/fmnist", "https://example.com/fmnist", "s3://bucket/fmnist"])
def test_a_remote_data_root_is_refused_as_remote_not_as_missing(url: str) -> None:
    """It was reported as a missing folder ``https:/example.com/…`` with advice to apt-get Fashion-MNIST. Only
    webdataset streams (tests/data/test_remote_shards.py)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.root={url}"])
    assert info.value.problems == [f"  - data.root: a remote root is read by data.format=webdataset only, not "
                                   f"data.format=raw: give a local folder (copy or mount the data there), or convert "
                                   f"it to webdataset shards and serve those (got {url!r})"]
    cfg = load_config(None, [f"data.root={url}", "data.format=webdataset"], check_data=False)
    assert str(cfg.data.root) == url


def test_missing_data_root_names_the_path_and_how_to_get_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.root={missing}", "model.num_members=0"])
    assert _problem_paths(info.value) == ["model.num_members", "data.root"]
    assert f"{missing} does not exist" in str(info.value)
    assert "apt-get install dataset-fashion-mnist" in str(info.value)
    with pytest.raises(ConfigError, match=r"data\.root: must be set for data\.dataset='cifar10'.*cifar-10-python"):
        load_config(None, ["data.dataset=cifar10"])
    # An existing root passes, synthetic data needs none, and check_data=False skips the check.
    assert load_config(None, [f"data.root={tmp_path}"]).data_root() == tmp_path
    assert load_config(None, ["data.dataset=synthetic", f"data.root={missing}"]).data.dataset == "synthetic"
    cfg = load_config(None, [f"data.root={missing}"], check_data=False)
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        check_paths(cfg)


def test_epochs_and_max_steps_together_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "train:\n  epochs: 3\n  max_steps: 100\n"), check_data=False)
    assert _problem_paths(info.value) == ["train.max_steps"]
    assert "set only one of train.epochs (here 3) and train.max_steps" in str(info.value)
    with pytest.raises(ConfigError, match=r"train\.epochs: set one of train\.epochs and train\.max_steps"):
        load_config(None, ["train.epochs=null"], check_data=False)


@pytest.mark.parametrize(("dataset", "fmt"), [("fashion_mnist", "raw"), ("cifar10", "raw"), ("cifar100", "ffcv"),
                                              ("cifar10", "webdataset"), ("synthetic", "raw")])
def test_randaugment_is_refused_where_no_reader_applies_it(dataset: str, fmt: str) -> None:
    """Their readers, raw and converted, keep their own augmentation: the value would be dropped without a word."""
    rand = "rand-m9-mstd0.5-inc1"
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.dataset={dataset}", f"data.format={fmt}", f"train.randaugment={rand}"],
                    check_data=False)
    assert info.value.problems == [f"  - train.randaugment: data.dataset={dataset!r} does not apply it (its readers "
                                   "keep their own augmentation); it applies to data.dataset imagenet, imagefolder "
                                   f"only; set it to null (got {rand!r})"]


@pytest.mark.parametrize("fmt", ["raw", "ffcv", "webdataset"])
def test_randaugment_is_taken_by_the_datasets_the_refusal_names(fmt: str) -> None:
    for dataset in ("imagenet", "imagefolder"):
        cfg = load_config(None, [f"data.dataset={dataset}", f"data.format={fmt}", "train.randaugment=rand-m9"],
                          check_data=False)
        assert cfg.train.randaugment == "rand-m9"


def test_a_stored_run_that_ignored_randaugment_loads_as_it_trained() -> None:
    """A checkpoint saved before the refusal trained without it: eval and export (no train.* overrides) still load
    it, with null, in one warning; a value its readers applied is kept."""
    stored = load_config(None, ["data.dataset=cifar10"], check_data=False).model_dump(mode="json")
    stored["train"]["randaugment"] = "rand-m9"
    with pytest.warns(UserWarning, match=r"^ckpt: train.randaugment='rand-m9' was never applied to "
                                         r"data.dataset='cifar10' \(its readers ignored it\); read as null"):
        assert config_from_dict(stored, source="ckpt", check_data=False).train.randaugment is None
    assert stored["train"]["randaugment"] == "rand-m9"  # the caller's dict is not changed
    stored["data"]["dataset"] = "imagefolder"
    assert config_from_dict(stored, source="ckpt", check_data=False).train.randaugment == "rand-m9"


def test_yaml_details(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\nreg:\n  lambda: 1e-3\n  tau: 5e-1\ntracking:\n  run_name: 2024-05-01\n")
    cfg = load_config(path, check_data=False)
    assert cfg.model == Config().model  # an empty section means its defaults
    assert cfg.reg.lam == 1e-3 and cfg.reg.tau == 0.5 and cfg.tracking.run_name == "2024-05-01"
    with pytest.raises(ConfigError, match=r"  - tau: key given twice, on lines 2 and 3"):
        load_config(_write(tmp_path, "reg:\n  tau: 0.1\n  tau: 0.2\n"), check_data=False)
    with pytest.raises(ConfigError, match=r"reg\.lambda: given twice, as reg\.lam and as reg\.lambda"):
        load_config(_write(tmp_path, "reg:\n  lam: 0.1\n  lambda: 0.2\n"), check_data=False)
    with pytest.raises(ConfigError, match=r"\(file\): not valid YAML"):
        load_config(_write(tmp_path, "model: [unclosed\n"), check_data=False)
    with pytest.raises(ConfigError, match=r"model\.name: timm has no model 'resnet81' \(did you mean 'resnet18'\?\)"):
        load_config(None, ["model.name=resnet81"], check_data=False)


def test_save_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "imagenet_vit.yaml", ["model.kwargs.img_size=32", "model.kwargs.drop_rate=0.1",
                                                                "reg.lambda=2.5e-5", "model.layers=[blocks.*]",
                                                                f"data.root={tmp_path}", "seed=7"])
    out = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert out == tmp_path / "run" / "config.yaml"
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # the temporary file was renamed, not left
    text = out.read_text()
    assert f"root: {tmp_path}\n" in text and "lambda: 2.5e-05\n" in text
    back = load_config(out)
    assert back == cfg
    assert back.optim.betas == (0.9, 0.999) and back.model.kwargs == {"img_size": 32, "drop_rate": 0.1}
    assert back.train.epochs == 300 and back.train.max_steps is None
    save_config(back, out)  # overwriting an existing file works too
    assert load_config(out) == cfg


def test_flatten_gives_dotted_scalar_keys() -> None:
    flat = flatten(load_config(None, ["model.kwargs.img_size=32", "reg.lambda=0.01"], check_data=False))
    assert flat["model.num_members"] == 4 and flat["reg.tau"] == 0.5 and flat["reg.lambda"] == 0.01
    assert flat["model.kwargs.img_size"] == 32 and flat["optim.betas"] == "[0.9, 0.999]"
    assert flat["run_dir"] == "runs/default" and flat["data.root"] is None and flat["seed"] == 0
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in flat.values())
    assert "model" not in flat and "model.kwargs" not in flat
    assert len([k for k in flat if k.startswith("train.")]) == len(TrainConfig.model_fields)
