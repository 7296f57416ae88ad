# Sourced by the session scripts: test dependencies a lent GPU machine may lack
# (src-method, quimb and theirs), carried as wheels in .whl/ (git-ignored) and
# installed into /tmp/site. By name, so pip takes the wheel built for this
# machine's Python where several are carried.
if [ -d .whl ]; then
  names=$(ls .whl/*.whl | sed 's#.*/##; s/-.*//' | sort -u)
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site $names && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
