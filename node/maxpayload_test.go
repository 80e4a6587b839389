package node_test

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// A server's max_payload bounds what the node publishes too: on a server
// allowing 64 KiB, one store job of 1,200 chunks with 32-byte hashes makes
// a ~80 KiB BlockStored event and a ~150 KiB stored message. Each goes out
// cut into messages that fit (kv_events at the server's limit, not at
// kvactors' own 512 KiB; the job's stored in parts with the job's number),
// not refused whole and lost.
func TestMessagesPastTheServersMaxPayloadAreCut(t *testing.T) {
	t.Parallel()
	const maxPayload = 64 << 10
	s := testkit.NATSServerWith(t, func(o *server.Options) { o.MaxPayload = maxPayload })
	e := startNode(t, func(c *node.Config) { c.NATSURL = s.ClientURL(); c.PoolBytes = 4 << 20 })
	router := newKVRouter(t, e.nc)
	o := defaultOpts()
	o.blocks = 2048
	te := e.newEngine("e1", o)
	te.register()

	const chunks = 1200
	hs := make([]string, chunks)
	ids := make([]int, chunks)
	for i := range hs {
		h := sha256.Sum256(fmt.Appendf(nil, "payload-%d", i))
		hs[i] = hex.EncodeToString(h[:])
		ids[i] = i + 1
	}
	te.send(added("r", 4*chunks))
	for lo := 0; lo < chunks; lo += 400 { // each batch under the server's max_payload
		te.send(hashesEv("r", lo, hs[lo:lo+400]...))
		te.send(blocksEv("r", 0, lo, ids[lo:lo+400]...))
	}
	te.send(tokensEv("r", 4*chunks, 4*chunks)) // one job of every chunk

	// stored: the job's chunks, each once, over several messages of the
	// one job whose bytes add up to the chunks'.
	seen := map[int]bool{}
	var parts int
	var bytes int64
	job := -1
	for len(seen) < chunks {
		st := recv(t, te.stored, "the job's stored messages")
		parts++
		if job < 0 {
			job = int(st.Job)
		}
		require.Equal(t, job, int(st.Job), "every part names the job")
		for _, c := range st.Chunks {
			require.False(t, seen[int(c.Index)], "chunk %d announced twice", c.Index)
			seen[int(c.Index)] = true
		}
		bytes += st.Bytes
	}
	require.Greater(t, parts, 1, "a stored past max_payload goes out in parts")
	require.Equal(t, int64(chunks*o.bpc)*o.blockBytes, bytes, "the parts' bytes add up to the job's")

	// kv_events: the router learns of every chunk.
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		router.mu.Lock()
		defer router.mu.Unlock()
		if router.bad != nil {
			return router.bad
		}
		believed := 0
		for _, h := range hs {
			if router.cpu[h] {
				believed++
			}
		}
		if believed != chunks {
			return fmt.Errorf("the router believes %d of the %d chunks the pool holds", believed, chunks)
		}
		return nil
	})
	for _, kind := range []string{messages.VerbStored, messages.VerbKVEvents} {
		require.Zero(t, e.counter("kvactors_nats_publish_failures_total", kind), kind)
	}
}
