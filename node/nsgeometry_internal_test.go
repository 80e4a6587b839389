package node

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/sched"
)

// A namespace with no member keeps no layout: a spec may carry 64 groups
// of 4096 regions (7.6 MB of layout), and the node keeps up to 16 ×
// --max-engines namespaces after their engines leave, so keeping the
// opener's layout let fresh ids pile up tens of GB. It keeps the
// geometry's digest instead, and a register into it is still checked: the
// same geometry joins (and the namespace holds the joiner's layout while it
// is a member), another is refused.
func TestAMemberlessNamespaceKeepsNoLayout(t *testing.T) {
	layout := func(blockBytes int64) *sched.Layout { return oneGroupLayout(t, 1, blockBytes) }
	var t2 namespaces
	ns := t2.commit("alpha", "e1", layout(8))
	require.NotNil(t, ns.layout)
	t2.mu.Lock()
	t2.leaveLocked("e1")
	t2.mu.Unlock()
	require.Nil(t, ns.layout, "a namespace with no member keeps its opener's layout")

	_, err := t2.check("e1", "alpha", layout(16), 100)
	require.ErrorIs(t, err, ErrRegister)
	require.Contains(t, err.Error(), "geometry")
	id, err := t2.check("e1", "alpha", layout(8), 100)
	require.NoError(t, err)
	require.Equal(t, ns.id, id)
	joiner := layout(8)
	t2.commit("alpha", "e1", joiner)
	require.Same(t, joiner, ns.layout, "a member's layout, for the detailed check")
	_, err = t2.check("e1", "alpha", layout(16), 100)
	require.ErrorContains(t, err, "block_bytes 16, the namespace holds 8")
}
