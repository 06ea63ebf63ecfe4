# volutectl's turn wrapper, the main process of each turn scope: runs "$@" (the mind's
# command), and records that it started and how it ended on fd 9, the turn directory's
# status file, which the gate opened for it: a gate that restarted meanwhile can still
# read the outcome there. The command does not inherit fd 9, and the file's name is in a
# directory the turn cannot write. Builtins only: it sits on the handoff path. `trap :`
# keeps it alive through a SIGINT/SIGTERM sent to the whole scope, so it can still record
# the status; the command gets default dispositions.
trap : INT TERM HUP
echo started >&9
"$@" 9>&-
s=$?
echo "$s" >&9
exit "$s"
