package node_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
)

// The engine SDK refuses, at the call, exactly the events a real node
// would reject at its bounds, and no others: at each edge (the last GPU
// block id, the last hash and block id a request may hold under the spec's
// max_model_len, per group) the SDK sends what is within it, the node
// takes all of it (nothing rejected, the request released), and the SDK
// refuses one past it with ErrOutOfRange.
func TestTheSDKRefusesWhatTheNodeRejectsAtEachBound(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	o := defaultOpts()
	o.tpb = []int{4, 8} // group 1's blocks hold twice the tokens: half the ids
	te := e.newEngine("e1", o)
	te.spec.MaxModelLen = 200 // 50 hashes, 50 ids in group 0, 25 in group 1
	enc, err := nats.Connect(e.node.NATSURL(), client.Options("e1")...)
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	released := make(chan client.Release, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.Connect(ctx, enc, client.Config{Engine: "e1", Spec: te.spec,
		OnReleased: func(r client.Release) { released <- r }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })

	ids := func(n int, id uint32) []uint32 {
		s := make([]uint32, n)
		for i := range s {
			s[i] = id
		}
		return s
	}
	hashes := func(n int) [][]byte {
		hs := make([][]byte, n)
		for i := range hs {
			hs[i] = []byte{byte(i), byte(i >> 8), 7, 7, 7, 7, 7, 7}
		}
		return hs
	}
	require.NoError(t, c.Added("r", 200))
	past := map[string]error{
		"block id 64 of 64":     c.Blocks("r", 0, 0, []uint32{64}),
		"51 hashes of 50":       c.Hashes("r", 0, hashes(51)...),
		"51 ids of 50, group 0": c.Blocks("r", 0, 0, ids(51, 1)),
		"26 ids of 25, group 1": c.Blocks("r", 1, 0, ids(26, 1)),
	}
	for what, err := range past {
		require.ErrorIs(t, err, client.ErrOutOfRange, what)
	}
	require.NoError(t, c.Hashes("r", 0, hashes(50)...))
	require.NoError(t, c.Blocks("r", 0, 0, ids(49, 1)))
	require.NoError(t, c.Blocks("r", 0, 49, []uint32{63}), "the last GPU block, the 50th id")
	require.NoError(t, c.Blocks("r", 1, 0, ids(25, 2)))
	require.NoError(t, c.Tokens("r", 200, 200))
	require.NoError(t, c.Finished("r", false, 200, 200))
	require.NoError(t, c.Flush())
	require.Equal(t, "r", testkit.Recv(t, released, 10*time.Second, "r's release").Request)
	require.Zero(t, e.counter("kvactors_events_rejected_total", ""), "the node rejected nothing the SDK sent")
	require.Equal(t, len(past), c.Stats().OutOfRange)

}
