"""Pure Slurm parsers, tested on literal strings captured from Slurm 22.05."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcstagger.errors import ConfigError, LaunchError
from hpcstagger.slurm import expand_nodelist, het_component, job_context, parse_sbatch_parsable, parse_scontrol

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("text, hosts", [
    ("vm", ["vm"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("node[1-2,7],gpu5", ["node1", "node2", "node7", "gpu5"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[1-2]-ib, b", ["a1-ib", "a2-ib", "b"]),
    ("", []),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node1-2]", "node[3-1]", "node[a-b]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ConfigError, match="node list"):
        expand_nodelist(bad)


def test_parse_scontrol_multiline_record():
    (rec,) = parse_scontrol((DATA / "scontrol_show_job.txt").read_text())
    assert rec["JobId"] == "1"
    assert rec["JobName"] == "my job"  # a value with a space
    assert rec["JobState"] == "PENDING"
    assert rec["TRES"] == "cpu=2,mem=1M,node=1,billing=2"  # a value holding '='
    assert rec["NodeList"] == ""
    assert rec["AllocNode:Sid"] == "localhost:1054"
    assert rec["StdOut"] == "/tmp/hpcstagger-slurm-z3iacrjc/jobs/slurm-1.out"
    assert rec["Power"] == ""


def test_parse_scontrol_one_line_records_match_multiline():
    one, two = parse_scontrol((DATA / "scontrol_show_job_oneliner.txt").read_text())
    (multi,) = parse_scontrol((DATA / "scontrol_show_job.txt").read_text())
    assert one == multi
    assert two["JobId"] == "2" and two["JobState"] == "COMPLETED" and two["NodeList"] == "vm"


def test_parse_scontrol_empty():
    assert parse_scontrol("") == []


@pytest.mark.parametrize("text, job", [("17\n", 17), ("42;cluster\n", 42), ("warning: x\n9\n", 9)])
def test_parse_sbatch_parsable(text, job):
    assert parse_sbatch_parsable(text) == job


def test_parse_sbatch_parsable_rejects_garbage():
    with pytest.raises(LaunchError, match="could not read a job id"):
        parse_sbatch_parsable("Submitted batch job 5")


def test_job_context_outside_and_inside_a_job():
    assert job_context({}) is None
    ctx = job_context({"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "4",
                       "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_ON_NODE": "8", "SLURM_JOB_NAME": "x"})
    assert ctx["job_id"] == 12 and ctx["nodes"] == ["n1", "n2"] and ctx["ntasks"] == 4
    assert ctx["num_nodes"] == 2 and ctx["cpus_on_node"] == 8 and ctx["array_task_id"] is None


# The variables a task of `srun --het-group=0,1` sees, as printed by Slurm 22.05 for 1 + 2 tasks.
HET_ENV = {"SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2",
           "SLURM_JOB_ID_HET_GROUP_0": "1", "SLURM_JOB_ID_HET_GROUP_1": "2"}


@pytest.mark.parametrize("procid, component", [("0", 0), ("1", 1), ("2", 1), ("3", None)])
def test_het_component_from_procid_and_group_sizes(procid, component):
    assert het_component({**HET_ENV, "SLURM_PROCID": procid}) == component


def test_het_component_outside_a_het_step():
    assert het_component({"SLURM_PROCID": "0"}) is None
    assert het_component({**HET_ENV}) is None
