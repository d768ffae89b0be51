"""The chart's crds/ folder is a byte-for-byte copy of manifests/crd/ (hack/sync-crds.sh)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "manifests" / "crd"
CHART_CRDS = ROOT / "charts" / "specdeploy" / "crds"


def _yaml_names(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.yaml")}


def test_crd_source_exists():
    assert (SOURCE / "specdeploy.dev_specdecodedeployments.yaml").is_file()


def test_chart_carries_exactly_the_source_crds():
    assert _yaml_names(CHART_CRDS) == _yaml_names(SOURCE), "run hack/sync-crds.sh"


def test_chart_crds_are_identical_to_the_source():
    stale = [
        name
        for name in sorted(_yaml_names(SOURCE))
        if (CHART_CRDS / name).read_bytes() != (SOURCE / name).read_bytes()
    ]
    assert not stale, f"charts/specdeploy/crds/ is stale for {stale}: run hack/sync-crds.sh"
