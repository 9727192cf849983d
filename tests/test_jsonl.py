"""The JSONL task's loader (asyncrl/tasks/jsonl.py): lines end at ``\\n`` only, so text
JSON allows inside a string (U+2028, U+2029, U+0085) is kept; every bad line is one
ConfigError naming ``task.path`` and the line's number."""

from __future__ import annotations

import json
import os

import pytest

from asyncrl.config import ConfigError
from asyncrl.tasks.jsonl import JsonlTask


def write(tmp_path, data: bytes):
    p = tmp_path / "q.jsonl"
    p.write_bytes(data)
    return p


def test_line_and_paragraph_separators_inside_strings_are_text(tmp_path):
    rows = [{"prompt": "a\u2028b", "answer": "1"}, {"prompt": "c\u2029d\u0085e", "answer": 2}]
    # ensure_ascii=False: the separators are written raw, as most JSON writers leave them
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    task = JsonlTask(str(write(tmp_path, b"\xef\xbb\xbf" + data + b"\r\n  \n")))
    assert [(it.text, it.answer) for it in task.items] == [
        ("a\u2028b", "1"),
        ("c\u2029d\u0085e", "2"),
    ]
    assert "\u2028" in task.alphabet


BAD_LINES = {
    "not UTF-8": (b'{"prompt": "caf\xe9"}', "line 2: not UTF-8 (byte 0xe9 at byte 16 of the line)"),
    "empty prompt": (
        b'{"prompt": "", "answer": "1"}',
        "line 2: 'prompt' is \"\": expected a non-empty",
    ),
    "blank prompt": (b'{"prompt": " \\n "}', "line 2: 'prompt' is \" \\n \": expected a non-empty"),
    "null prompt": (
        b'{"prompt": null, "answer": "1"}',
        "line 2: 'prompt' is null: expected a non-empty",
    ),
    "list prompt": (
        b'{"prompt": ["a"]}',
        "line 2: 'prompt' is [\"a\"]: expected a non-empty string",
    ),
    "no prompt": (b'{"question": "a"}', "line 2: expected a JSON object with a 'prompt' key"),
    "not an object": (b'["a"]', "line 2: expected a JSON object with a 'prompt' key"),
    "not JSON": (b'{"prompt": "a"', "line 2: not JSON (Expecting ',' delimiter at column 15)"),
    "too deep": (b"[" * 100_000, "line 2: not JSON (nested too deeply)"),
    "dict answer": (
        b'{"prompt": "a", "answer": {"x": 1}}',
        "line 2: 'answer' is {\"x\": 1}: expected",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_is_one_config_error_naming_the_path_and_line(tmp_path, case):
    line, want = BAD_LINES[case]
    p = write(tmp_path, b'{"prompt": "1+1=", "answer": "2"}\n' + line + b"\n")
    with pytest.raises(ConfigError) as e:
        JsonlTask(str(p))
    msg = str(e.value)
    assert msg.startswith(f"task.path={p} {want}"), msg
    assert "\n" not in msg


def test_a_null_answer_is_no_answer(tmp_path):
    task = JsonlTask(str(write(tmp_path, b'{"prompt": "a", "answer": null}\n{"prompt": 7}\n')))
    assert [(it.text, it.answer) for it in task.items] == [("a", ""), ("7", "")]


def test_a_missing_empty_or_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match=f"^task.path={tmp_path / 'nope'}: no such file$"):
        JsonlTask(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="holds no prompts"):
        JsonlTask(str(write(tmp_path, b"\n \n")))
    p = write(tmp_path, b'{"prompt": "a"}\n')
    p.chmod(0)
    try:
        if os.access(p, os.R_OK):
            pytest.skip("running as root: a mode-0 file is still readable")
        with pytest.raises(
            ConfigError, match=f"^task.path={p}: cannot be read \\(Permission denied\\)$"
        ):
            JsonlTask(str(p))
    finally:
        p.chmod(0o644)
