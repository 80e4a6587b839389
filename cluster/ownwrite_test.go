package cluster

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
)

// A register is read while the owner's keep-alive is in flight: its write
// has landed, its reply is not back, so the record shows this process at a
// revision past the one it knows. The owner still holds the engine: a
// register naming another node is refused (before, the owner took its own
// lease for lapsed and left the register to the named node, which ignores
// an engine another node owns: nobody answered), and one naming no node is
// served without another write.
func TestARegisterReadDuringItsOwnersKeepAliveIsAnsweredByTheOwner(t *testing.T) {
	t.Parallel()
	a, _, rev := ownerOfE1(t)
	ctx := ctxT(t)

	a.sending("e1", time.Now()) // the keep-alive, sent ...
	landed, err := a.kv.Update(ctx, "e1", ownership.EncodeRecord(ownership.Record{Identity: a.me,
		LeaseMS: staleLease.Milliseconds(), Renewed: time.Now().UnixMilli()}), rev) // ... and landed, its reply not back
	require.NoError(t, err)

	d, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true, SpecNode: "gpu-b", NamedLive: true})
	require.NoError(t, err)
	require.Equal(t, ownership.Refuse, d.Action, d.Reason)
	require.Equal(t, "gpu-a", d.Owner)

	d, err = a.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	require.Equal(t, ownership.Serve, d.Action, d.Reason)
	e, err := a.kv.Get(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, landed, e.Revision(), "served on the landed write, nothing written again")
	// What Resolve served on, Serving and the fencing token say too: the
	// landed write is the claim's renewal, sent when the keep-alive was.
	require.Equal(t, landed, a.Revision("e1"), "the claim's token is the landed write's")
	require.True(t, a.Serving("e1", time.Now()))
}

// A record of this process past the revision it knows, with no write of
// its own sent since (only a bucket that lost writes and issued revisions
// again could show it), is not taken for a renewal: the owner's lease is
// judged lapsed and a register naming another node is left to that node.
func TestARecordOfItsOwnWithNoWriteSentIsNotARenewal(t *testing.T) {
	t.Parallel()
	a, _, rev := ownerOfE1(t)
	ctx := ctxT(t)
	_, err := a.kv.Update(ctx, "e1", ownership.EncodeRecord(ownership.Record{Identity: a.me,
		LeaseMS: staleLease.Milliseconds(), Renewed: time.Now().UnixMilli()}), rev)
	require.NoError(t, err)

	d, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true, SpecNode: "gpu-b", NamedLive: true})
	require.NoError(t, err)
	require.Equal(t, ownership.Ignore, d.Action, d.Reason)
}
