"""How the suite is split across pytest-xdist's workers (tests/conftest.py): files that
share a session fixture go to one worker, and the table of seconds that orders the
groups is read from a JUnit report."""

from __future__ import annotations

from pathlib import Path

from conftest import group_of
from durations import file_seconds, load


def test_files_sharing_a_session_engine_or_run_are_one_group():
    assert {group_of(f) for f in ("test_actor_vllm.py", "test_engine_contract.py",
                                  "test_envs_messages.py", "test_agent_endpoint.py")} == {"vllm_actor"}  # fmt: skip
    assert group_of("test_eval.py") == group_of("test_user_loss.py") == "short_cli_run"
    assert group_of("test_steer_run.py") == group_of("test_reward_model_run.py") == "short_cli_run"
    assert group_of("test_inspect.py") == group_of("test_replay_tool.py") == "tool_run"
    assert group_of("test_e2e.py") == group_of("test_hacking_run.py") == "default_run"
    assert group_of("test_config.py") == "test_config.py"
    assert group_of("test_not_there.py") == "test_not_there.py"


def test_file_seconds_sums_setup_call_and_teardown_per_file(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="1.5"/>'
        '<testcase classname="tests.test_a.TestK" name="t2" time="2.0"/>'
        '<testcase classname="tests.test_b" name="t3" time="0.25"/>'
        '<testcase classname="elsewhere" name="t4" time="9"/>'
        "</testsuite></testsuites>"
    )
    assert file_seconds(junit) == {"test_a.py": 3.5, "test_b.py": 0.2}


def test_the_shipped_table_names_test_files_that_exist():
    table = load()
    here = {p.name for p in Path(__file__).parent.glob("test_*.py")}
    assert table and set(table) <= here, set(table) - here


def test_groups_of_equal_seconds_keep_their_collection_order(monkeypatch):
    """Every worker must order the items alike: a group's seconds do not depend on the
    order its files are summed in (0.1 + 0.2 + 0.3 is not 0.3 + 0.2 + 0.1 in floats),
    and equal seconds keep the order of collection."""
    from types import SimpleNamespace

    import durations
    from conftest import order_for_workers

    seconds = {"test_actor_vllm.py": 0.1, "test_engine_contract.py": 0.2,
               "test_envs_messages.py": 0.3, "test_config.py": 0.6}  # fmt: skip
    monkeypatch.setattr(durations, "load", lambda: seconds)
    tests = Path(__file__).parent
    names = ["test_config.py", "test_envs_messages.py", "test_engine_contract.py",
             "test_actor_vllm.py"]  # fmt: skip
    items = [SimpleNamespace(path=tests / n) for n in names]
    order_for_workers(items)
    assert [i.path.name for i in items] == names  # a tie: the first collected goes first
