# Sourced by the other scripts: create or reuse .venv, (re)install the given requirement files (at the versions of
# constraints.txt) when they or the constraints change, and put the venv first on PATH.
venv_setup() {
    [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
    local want stamp=.venv/.requirements.sha1
    want=$(cat "$@" constraints.txt | sha1sum)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "installing $* into .venv ..."
        # A bare 'torch' may resolve to a multi-GB CUDA build; pin the tested release unless torch is already there.
        .venv/bin/python -c "import torch" 2>/dev/null ||
            .venv/bin/pip install -q --no-compile "${TORCH_SPEC:-torch==2.13.0}"
        local reqs=()
        for f in "$@"; do reqs+=(-r "$f"); done
        # constraints.txt: the versions the suite passed with (a new release is a tested change, not a surprise)
        .venv/bin/pip install -q --no-compile -c constraints.txt "${reqs[@]}"
        # pip byte-compiles on one core; compileall on all of them (~30 s less on 2 cores), leaving out the
        # packages' own test folders (~12 s more). It fails on the few files written for a newer Python (as pip's
        # own pass does, which ignores them).
        .venv/bin/python -m compileall -q -j 0 -x '/tests?/' .venv/lib >/dev/null || true
        echo "$want" > "$stamp"
    fi
    # The project itself, editable: its root scripts and smallgpt/ importable from any folder (data/*/prepare.py),
    # with no sys.path edits. The venv's setuptools builds it where there is one (no download), else pip fetches it.
    local python="$PWD/.venv/bin/python"
    # Found, not imported: importing the model is 2-3 s of every script's start.
    local found="import importlib.util as u; assert u.find_spec('smallgpt') and u.find_spec('model')"
    if ! (cd / && "$python" -c "$found" 2>/dev/null); then
        .venv/bin/pip install -q --no-deps --no-build-isolation -e . 2>/dev/null ||
            .venv/bin/pip install -q --no-deps -e .
    fi
    export PATH="$PWD/.venv/bin:$PATH"
}
