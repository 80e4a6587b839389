package sched

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// STYLE.md "Where code lives": sched is the pure core; it imports only the
// standard library and kvactors' messages and hostpool (types only),
// never protoactor, NATS or OTel.
func TestImportsOnlyStdlibAndCore(t *testing.T) {
	requireDeps(t, ".", map[string]bool{
		"github.com/kvactors/kvactors/sched":    true,
		"github.com/kvactors/kvactors/messages": true,
		"github.com/kvactors/kvactors/hostpool": true,
	})
}

// requireDeps runs go list -deps on pkg and requires every non-standard
// dependency to be allowed.
func requireDeps(t *testing.T, pkg string, allowed map[string]bool) {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go not on PATH")
	}
	out, err := exec.Command(goBin, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg).CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	deps := strings.Fields(string(out))
	require.NotEmpty(t, deps)
	for _, d := range deps {
		require.True(t, allowed[d], "%s imports %s", pkg, d)
	}
}
