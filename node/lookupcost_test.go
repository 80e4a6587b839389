package node_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A lookup runs on its engine's intake shard, so its cost is what another
// engine of the shard waits (docs/PROTOCOL.md "lookup": each chunk of each
// group asked about at most once). mal's layout is full attention plus
// eagle, one token a hash and a block a chunk, with (aa,0), (bb,0) and
// (aa,1) stored; its lookup of aa×k then bb×(n-k) steps the hit down n-k
// times (quadratic by the first rule: seconds). It answers k promptly, and
// a heartbeat of engine b on the same shard, sent right after it, is
// answered promptly too.
func TestAHostileLookupDoesNotHoldUpItsShard(t *testing.T) {
	const n, k = 16000, 8000
	e := startNode(t)
	o := defaultOpts()
	o.tph, o.tpb, o.kinds, o.blockBytes = 1, []int{1, 1}, []string{"full", "eagle"}, 64
	mal := e.newEngine("mal", o)
	mal.register()
	b, ask, replies := stalledEngine(t, e, mal.id)
	b.register()

	mal.send(added("r", 2), hashesEv("r", 0, "aa", "bb"), blocksEv("r", 0, 0, 1, 2), blocksEv("r", 1, 0, 3),
		tokensEv("r", 2, 2), finishedEv("r", false, 2, 2))
	recv(t, mal.stored, "(aa,0), (bb,0), (aa,1) stored")
	recv(t, mal.released, "r released")

	hashes := strings.Split(strings.Repeat("aa,", k)+strings.TrimSuffix(strings.Repeat("bb,", n-k), ","), ",")
	data, err := json.Marshal(map[string]any{"hashes": hashes})
	require.NoError(t, err)
	begun := time.Now()
	require.NoError(t, e.nc.PublishRequest("kvactors.mal.lookup", "_INBOX.mal.stalled.lookup", data))
	ask("heartbeat", "hb", messages.HeartbeatRequest{Epoch: b.epoch, Seq: b.seq})

	const bound = 3 * time.Second // the first rule took seconds here without -race
	got := map[string]bool{}
	for len(got) < 2 {
		m := testkit.Recv(t, replies, bound, "the lookup's and the heartbeat's replies")
		tag := m.Subject[strings.LastIndex(m.Subject, ".")+1:]
		got[tag] = true
		switch tag {
		case "lookup":
			var r messages.LookupReply
			require.NoError(t, json.Unmarshal(m.Data, &r))
			require.Empty(t, r.Error)
			require.Equal(t, k, r.HitTokens, "eagle backs only [0, k)")
		case "hb":
			var r messages.HeartbeatReply
			require.NoError(t, json.Unmarshal(m.Data, &r))
			require.Empty(t, r.Error)
		default:
			t.Fatalf("unexpected reply on %s", m.Subject)
		}
	}
	require.Less(t, time.Since(begun), bound, fmt.Sprintf("lookup of %d hashes and b's heartbeat", n))
}
