"""The docs stay true: docs/spec.md is what the schema generates and names every spec key, and CI runs exactly the
README's test command."""

from pathlib import Path

from pydantic import BaseModel

from rollplex.graph.spec import Spec

ROOT = Path(__file__).resolve().parents[1]


def spec_keys(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        nested = [
            inner
            for outer in (field.annotation, *getattr(field.annotation, "__args__", ()))
            for inner in (outer, *getattr(outer, "__args__", ()))
            if isinstance(inner, type) and issubclass(inner, BaseModel)
        ]
        if nested and name != "rewards":
            yield from spec_keys(nested[0], key + ".")
        else:
            yield key


def test_the_spec_reference_is_generated_from_the_schema_and_names_every_key():
    from rollplex.report.specdoc import spec_reference

    doc = (ROOT / "docs" / "spec.md").read_text()
    assert doc == spec_reference(), "docs/spec.md is stale: python -m rollplex.report.specdoc > docs/spec.md"
    missing = [k for k in spec_keys(Spec) if f"`{k}`" not in doc]
    assert not missing, f"docs/spec.md lacks {missing}"
    # an optional section has a row of its own, and its keys are required only with it
    assert "| `workload.video` | VideoSpec or null | `null` |" in doc
    assert "| `workload.video.frames` | int (> 0) | required with `workload.video` |" in doc


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    tests = readme[readme.index("## Tests") :].splitlines()
    command = next(line.strip() for line in tests[1:] if line.startswith("    "))
    ci = (ROOT / ".ci" / "run").read_text()
    assert any(line.split("#")[0].strip() == command for line in ci.splitlines())


def test_every_package_of_rollplex_is_listed_for_the_wheel():
    """A non-editable install holds only the packages pyproject.toml lists: each one with an __init__.py."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rollplex").rglob("__init__.py")}
    assert found == listed
