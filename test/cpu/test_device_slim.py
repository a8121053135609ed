"""scripts/device_slim.sh: result folders out of the working tree for a device call, and back, losing no edit."""
import subprocess

from repo_scripts import REPO

SCRIPT = str(REPO / "scripts" / "device_slim.sh")


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def slim(repo, what):
    return subprocess.run(["bash", SCRIPT, what], cwd=repo, capture_output=True, text=True)


def test_out_and_back_round_trip_and_refusals(tmp_path):
    repo = tmp_path / "r"
    files = {"benchmark/results/eplb/a.json": "1", "benchmark/results/mla_decode/README.md": "2",
             "benchmark/results/swapab/kept.json": "3"}
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results")

    r = slim(repo, "out")
    assert r.returncode == 0 and "restores them" in r.stdout, r.stderr
    assert not (repo / "benchmark/results/eplb").exists() and not (repo / "benchmark/results/mla_decode").exists()
    assert (repo / "benchmark/results/swapab/kept.json").read_text() == "3"  # the folders tests import stay
    r = slim(repo, "back")
    assert r.returncode == 0 and all((repo / rel).read_text() == text for rel, text in files.items())

    # an edit under the folders: 'out' refuses and removes nothing; 'back' restores only what is missing
    (repo / "benchmark/results/mla_decode/README.md").write_text("edited")
    r = slim(repo, "out")
    assert r.returncode == 2 and "commit them first" in r.stderr and (repo / "benchmark/results/eplb/a.json").exists()
    (repo / "benchmark/results/eplb/a.json").unlink()
    assert slim(repo, "back").returncode == 0
    assert (repo / "benchmark/results/eplb/a.json").read_text() == "1"
    assert (repo / "benchmark/results/mla_decode/README.md").read_text() == "edited"
    assert slim(repo, "").returncode == 2
