package node_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A remote load fails at its first chunk that fails: the fetches of the
// rest are cancelled, not each waited out (a holder whose fetch server is
// stuck, its heartbeats going on, cost a piece timeout per four chunks:
// 16 chunks at a 1 s timeout answered after 4 s), and the reply names the
// first failure and how many more chunks failed, not each one (thousands
// of errors joined passed max_payload and the load went unanswered).
func TestARemoteLoadFailsAtItsFirstFailedChunk(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2) // FetchTimeout 1 s
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(1, "ec", "m")
	a.register()
	c.register()
	const chunks = 16
	hs := make([]string, chunks)
	ids := make([]int, chunks)
	for i := range hs {
		hs[i] = hash("slow", i)
		ids[i] = i + 1
		a.fill(0, messages.BlockID(i+1), 3)
	}
	a.send(added("r", 4*chunks), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, ids...), tokensEv("r", 4*chunks, 4*chunks))
	recv(t, a.stored, "stored by A")
	awaitLookup(t, c, hs, 4*chunks, "C")

	// A's fetch server gets stuck on its first read (its heartbeats go on).
	_, release := kc.nodes[0].node.HoldAllInClusterGate("read", 64)
	defer release()
	to := make([]int, chunks)
	for i := range to {
		to[i] = 20 + i
	}
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": hs, "num_tokens": 4 * chunks, "blocks": [][]int{to}})
	start := time.Now()
	m, err := testkit.EngineRequest(c.e.nc, c.id, "kvactors."+c.id+".load", body, 30*time.Second)
	took := time.Since(start)
	require.NoError(t, err)
	var r messages.LoadReply
	require.NoError(t, json.Unmarshal(m.Data, &r))
	require.False(t, r.OK)
	require.Less(t, took, 2*time.Second, "answered after %v: the other chunks' timeouts were waited out", took)
	require.Less(t, len(r.Error), 1024, "one failure named, the rest counted: %s", r.Error)
	require.Contains(t, r.Error, "context deadline exceeded")
}
