# volutectl's turn wrapper, the main process of each turn scope: runs "$@" (the mind's
# command), and records that it started and how it ended in $VOLUTE_TURN_DIR, where a
# gate that restarted meanwhile can still read the outcome. Builtins only: it sits on
# the handoff path. `trap :` keeps it alive through a SIGINT/SIGTERM sent to the whole
# scope, so it can still record the status; the command gets default dispositions.
trap : INT TERM HUP
: > "$VOLUTE_TURN_DIR/started"
"$@"
s=$?
echo "$s" > "$VOLUTE_TURN_DIR/status"
exit "$s"
