# Sourced by the launchers: $PYTHON, a Python that imports maxtrain ($PYTHON if set, else python3), or one
# line saying what to activate, exit 2.
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import maxtrain' 2>/dev/null; then
  echo "$(basename "$0"): $PYTHON cannot import maxtrain: activate the environment it is installed in (e.g." \
       "source .venv/bin/activate), or install it: pip install -e ." >&2
  exit 2
fi
