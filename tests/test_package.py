import json
import subprocess
import sys

import lessmem


def test_version():
    assert lessmem.__version__.count(".") == 2


def test_import_is_cheap():
    """`import lessmem` must not pull in transformers or initialise CUDA."""
    code = (
        "import sys, lessmem, lessmem.formats, lessmem.plan; "
        "import json; print(json.dumps({'tf': 'transformers' in sys.modules, "
        "'cuda': __import__('torch').cuda.is_initialized()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    flags = json.loads(out.stdout.strip().splitlines()[-1])
    assert flags == {"tf": False, "cuda": False}


def test_unknown_attribute():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lessmem.nope  # noqa: B018


def test_cli_help_and_version():
    out = subprocess.run([sys.executable, "-m", "lessmem", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("plan", "explore", "eval", "generate", "quantize", "presets"):
        assert cmd in out.stdout
    out = subprocess.run([sys.executable, "-m", "lessmem", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"lessmem {lessmem.__version__}"
