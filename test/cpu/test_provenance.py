"""The provenance record every results JSON carries: the commit (GIT_COMMIT on the device host, else HEAD, marked
dirty when tracked files differ, "unknown" outside a repository) and the GPU with its sm_XY capability."""
import re
import subprocess

from sglang_h20 import compat, provenance


def git(cwd, *args):
    subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_the_commit_is_head_marked_dirty_by_tracked_changes_and_unknown_outside_a_repository(monkeypatch, tmp_path):
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.setattr(provenance, "REPO", repo)
    assert provenance.git_commit() == "unknown"  # not a repository yet: git rev-parse fails
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("one")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-qm", "one")
    head = provenance.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}", head)
    (repo / "untracked.txt").write_text("not a change to the code")
    assert provenance.git_commit() == head
    (repo / "a.txt").write_text("two")
    assert provenance.git_commit() == head + "+dirty"
    monkeypatch.setenv("GIT_COMMIT", "abc123")  # the device host has no .git: the caller names the commit
    assert provenance.git_commit() == "abc123"


def test_the_record_names_the_gpu_and_its_capability(monkeypatch):
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 140.0))
    rec = provenance.record("bench --x 1")
    assert (rec["command"], rec["gpu"], rec["gpu_capability"]) == ("bench --x 1", "NVIDIA H200", "sm_90")
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA B200", (10, 3), 180.0))
    assert provenance.record()["gpu_capability"] == "sm_103"
    monkeypatch.setattr(compat, "gpu", lambda: None)
    rec = provenance.record()
    assert rec["gpu"] is None and rec["gpu_capability"] is None and rec["versions"]["sglang"] == "0.5.17"
