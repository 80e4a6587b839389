package cluster

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The building blocks together, as the wired nodes will use them: node A
// (on s0) stores a prefix of chunks and announces them on kv_events; node B
// (on s1) holds a copy of the last chunk; node C (on s2) counts the whole
// prefix as held in the cluster, fetches every chunk byte-identically, and
// once A is gone (no heartbeat) stops counting A within the lease and gets
// what B still holds from B.
func TestPrefixStoredOnAIsFoundAndFetchedByteIdenticallyOnC(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	ncA, ncB, ncC := c.Connect(0), c.Connect(1), c.Connect(2)
	feed, err := StartFeed(ncC, Config{Node: "gpu-2", Lease: testLease}, slog.New(slog.DiscardHandler), nil)
	require.NoError(t, err)
	t.Cleanup(feed.Close)
	require.NoError(t, ncC.Flush())
	f := fetcher(t, ncC, nil)

	const name = "llama-70b@rev3"
	ns := messages.ClusterNamespace(messages.NamespaceKey("eA", name), testGeometry) // how nodes key the shared namespace

	srcA, srcB := newMemSource(), newMemSource()
	var hashes []string
	want := map[messages.Key][]byte{}
	for i := range 4 {
		h := fmt.Sprintf("%064x", 1000+i)
		hashes = append(hashes, h)
		raw, _ := hex.DecodeString(h)
		k := holders.KeyOf(raw, 0)
		want[k] = randomBytes(uint64(i), 1<<20+512*i) // over one piece each
		srcA.put(ns, k, want[k])
	}
	last := holders.KeyOf(must(hex.DecodeString(hashes[3])), 0)
	srcB.put(ns, last, want[last])
	serve(t, ncA, "gpu-0", srcA)
	serve(t, ncB, "gpu-1", srcB)

	a := startFakeNode(t, ncA, "gpu-0", "a1", nil)
	startFakeNode(t, ncB, "gpu-1", "b1", []holders.NSKey{{NS: ns, Key: last}}) // known to C by catch-up
	// A's kv_events for its engine; interest of C's feed may still be
	// crossing the routes, so announce until C counts the whole prefix.
	heldPrefix := func() int {
		n := 0
		for _, h := range hashes {
			if len(feed.Holders(ns, holders.KeyOf(must(hex.DecodeString(h)), 0))) == 0 {
				break
			}
			n++
		}
		return n
	}
	testkit.Eventually(t, 10*time.Second, 50*time.Millisecond, func() error {
		a.kvEvents("eA", messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: hashes, GroupIdx: 0, Medium: messages.MediumCPU, Namespace: name})
		if n := heldPrefix(); n != len(hashes) {
			return fmt.Errorf("C counts %d of %d chunks held in the cluster", n, len(hashes))
		}
		// B's key arrives by C's catch-up of B, on its own schedule.
		if h := feed.Holders(ns, last); len(h) != 2 {
			return fmt.Errorf("C knows holders %v of the last chunk, want gpu-0 and gpu-1", h)
		}
		return nil
	})
	require.Equal(t, []string{"gpu-0", "gpu-1"}, feed.Holders(ns, last))
	// The same key in another namespace is another chunk: nobody holds it.
	require.Empty(t, feed.Holders("other", last))

	for k, w := range want {
		got, from, err := f.FetchAny(ctxT(t), feed.Holders(ns, k), ns, k, func(n int64) ([]byte, error) { return make([]byte, n), nil })
		require.NoError(t, err)
		require.Equal(t, "gpu-0", from)
		require.True(t, bytes.Equal(w, got), "chunk %x differs", []byte(k))
		require.Equal(t, CRC32C(w), CRC32C(got))
	}

	a.kill()
	gone := time.Now()
	testkit.Eventually(t, 2*testLease, 10*time.Millisecond, func() error {
		if n := heldPrefix(); n != 0 {
			return fmt.Errorf("C still counts %d chunks %v after A went silent", n, time.Since(gone))
		}
		return nil
	})
	require.Equal(t, []string{"gpu-1"}, feed.Holders(ns, last), "B still holds the last chunk")
	got, from, err := f.FetchAny(ctxT(t), feed.Holders(ns, last), ns, last, func(n int64) ([]byte, error) { return make([]byte, n), nil })
	require.NoError(t, err)
	require.Equal(t, "gpu-1", from)
	require.True(t, bytes.Equal(want[last], got))
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
