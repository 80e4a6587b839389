package hostpool

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// STYLE.md "Where code lives": hostpool holds the pool policy as plain code;
// it imports only the standard library and messages.
func TestImportsOnlyStdlibAndMessages(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go not on PATH")
	}
	out, err := exec.Command(goBin, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	for _, d := range strings.Fields(string(out)) {
		require.Contains(t, []string{"github.com/kvactors/kvactors/hostpool", "github.com/kvactors/kvactors/messages"}, d,
			"hostpool imports %s", d)
	}
}
