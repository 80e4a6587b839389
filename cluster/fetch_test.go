package cluster

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// memSource is a ChunkSource over a map, with the checksum computed when a
// chunk is put (as the pool does when it copies from the device).
type memSource struct {
	mu     sync.Mutex
	chunks map[string][]byte
	crcs   map[string]uint32
}

func newMemSource() *memSource {
	return &memSource{chunks: map[string][]byte{}, crcs: map[string]uint32{}}
}

func (s *memSource) put(ns string, key messages.Key, b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.chunks[ns+"/"+string(key)] = b
	s.crcs[ns+"/"+string(key)] = CRC32C(b)
}

func (s *memSource) ReadChunk(ns string, key messages.Key) ([]byte, uint32, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.chunks[ns+"/"+string(key)]
	if !ok {
		return nil, 0, fmt.Errorf("%w: %s/%x", ErrNoChunk, ns, []byte(key))
	}
	return b, s.crcs[ns+"/"+string(key)], nil
}

func randomBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func serve(t *testing.T, nc *nats.Conn, node string, src ChunkSource) {
	t.Helper()
	sub, err := ServeFetch(nc, "kvactors", node, src, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
}

func fetcher(t *testing.T, nc *nats.Conn, mod func(*Config)) *Fetcher {
	t.Helper()
	cfg := Config{}
	if mod != nil {
		mod(&cfg)
	}
	f, err := NewFetcher(nc, cfg, nil)
	require.NoError(t, err)
	return f
}

// Every size around the piece boundaries comes back byte-identical.
func TestFetchSizesAroundPieceBoundaries(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	src := newMemSource()
	serve(t, nc, "a", src)
	f := fetcher(t, testkit.Connect(t, s), nil)
	p := int(nc.MaxPayload() - messages.HeaderRoom)
	for i, n := range []int{0, 1, p - 1, p, p + 1, 3*p + 17} {
		key := messages.Key(fmt.Sprintf("k%d", i))
		want := randomBytes(uint64(i), n)
		src.put("m", key, want)
		got, err := f.Fetch(ctxT(t), "a", "m", key)
		require.NoError(t, err, "size %d", n)
		require.True(t, bytes.Equal(want, got), "size %d differs", n)
	}
	// Namespaces do not mix.
	_, err := f.Fetch(ctxT(t), "a", "other", "k1")
	require.ErrorIs(t, err, ErrRefused)
	require.ErrorContains(t, err, "other/"+hex.EncodeToString([]byte("k1")))
}

// A fetch of a 4 MiB chunk between clients on different NATS servers is
// byte-identical, whichever server the client is on.
func TestFetch4MiBAcrossServersIsByteIdentical(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	src := newMemSource()
	want := randomBytes(42, 4<<20)
	src.put("m", "big", want)
	serve(t, c.Connect(0), "a", src)
	for i := 1; i < 3; i++ {
		f := fetcher(t, c.Connect(i), nil)
		var got []byte
		// Interest in a.fetch crosses the routes asynchronously.
		testkit.Eventually(t, 5*time.Second, 20*time.Millisecond, func() error {
			var err error
			got, err = f.Fetch(ctxT(t), "a", "m", "big")
			return err
		})
		require.True(t, bytes.Equal(want, got), "via server %d", i)
	}
}

// relay stands between a fetch client and the real node "a", on node name
// "evil", and lets a test change each reply: the fault injected on the wire.
func relay(t *testing.T, nc *nats.Conn, change func(m *nats.Msg) *nats.Msg) {
	t.Helper()
	sub, err := nc.Subscribe(messages.NodeSubject("kvactors", "evil", messages.NodeVerbFetch), func(m *nats.Msg) {
		rep, err := nc.Request(messages.NodeSubject("kvactors", "a", messages.NodeVerbFetch), m.Data, 5*time.Second)
		if err != nil {
			return
		}
		if out := change(rep); out != nil {
			out.Subject = m.Reply
			_ = nc.PublishMsg(out)
		}
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
}

func offsetOf(m *nats.Msg) int64 {
	n, _ := strconv.ParseInt(m.Header.Get(HeaderOffset), 10, 64)
	return n
}

func TestFetchRefusesCorruptMissingAndLyingPieces(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	src := newMemSource()
	key := messages.Key("\x01\x02\x03")
	keyName := "m/010203"
	src.put("m", key, randomBytes(7, 3<<20))
	serve(t, nc, "a", src)
	client := testkit.Connect(t, s)
	f := fetcher(t, client, nil)
	// Only a dropped piece needs the timeout; the other faults are seen in
	// the reply, however slowly a loaded machine relays it.
	impatient := fetcher(t, client, func(c *Config) { c.FetchTimeout = 300 * time.Millisecond })
	second := nc.MaxPayload() - messages.HeaderRoom // where the second piece starts
	cases := []struct {
		name   string
		change func(*nats.Msg) *nats.Msg
		want   error
	}{
		{"a flipped byte in the second piece", func(m *nats.Msg) *nats.Msg {
			if offsetOf(m) == second {
				m.Data = bytes.Clone(m.Data)
				m.Data[5] ^= 0x40
			}
			return m
		}, ErrCorrupt},
		{"the second piece dropped", func(m *nats.Msg) *nats.Msg {
			if offsetOf(m) == second {
				return nil
			}
			return m
		}, ErrPiece},
		{"a piece one byte short", func(m *nats.Msg) *nats.Msg {
			if offsetOf(m) == second {
				m.Data = m.Data[:len(m.Data)-1]
			}
			return m
		}, ErrPiece},
		{"a piece claiming another checksum", func(m *nats.Msg) *nats.Msg {
			if offsetOf(m) > 0 {
				m.Header.Set(HeaderCRC, "00000000")
			}
			return m
		}, ErrPiece},
		{"a size over the client's limit", func(m *nats.Msg) *nats.Msg {
			m.Header.Set(HeaderSize, strconv.FormatInt(2<<30, 10))
			return m
		}, ErrPiece},
		{"a reply for another offset", func(m *nats.Msg) *nats.Msg {
			if offsetOf(m) > 0 {
				m.Header.Set(HeaderOffset, "0")
			}
			return m
		}, ErrPiece},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Each case relays through its own connection, so a dropped
			// reply of one case cannot leak into the next.
			rc := testkit.Connect(t, s)
			relay(t, rc, tc.change)
			fc := f
			if tc.name == "the second piece dropped" {
				fc = impatient
			}
			_, err := fc.Fetch(ctxT(t), "evil", "m", key)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, keyName, "the error names the key")
			require.ErrorContains(t, err, "node evil")
			require.NoError(t, rc.Drain())
		})
	}
	// And with nothing in between, the same chunk is fine.
	got, err := f.Fetch(ctxT(t), "a", "m", key)
	require.NoError(t, err)
	want, _, _ := src.ReadChunk("m", key)
	require.True(t, bytes.Equal(want, got))
	// No node at all.
	_, err = impatient.Fetch(ctxT(t), "nobody", "m", key)
	require.ErrorIs(t, err, ErrPiece)
	require.ErrorContains(t, err, keyName)
}

// A chunk corrupted in the pool (bytes changed after the checksum was
// taken) fails at the client the same way.
func TestFetchDetectsAChunkCorruptedAtTheSource(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	good := randomBytes(9, 100_000)
	bad := bytes.Clone(good)
	bad[99_999] ^= 1
	serve(t, nc, "a", ChunkSourceFunc(func(string, messages.Key) ([]byte, uint32, error) {
		return bad, CRC32C(good), nil
	}))
	_, err := fetcher(t, testkit.Connect(t, s), nil).Fetch(context.Background(), "a", "m", "k")
	require.ErrorIs(t, err, ErrCorrupt)
	require.ErrorContains(t, err, "m/6b")
}

// Bad requests get an error reply, never a panic or a piece.
func TestServeFetchRefusesBadRequests(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	serve(t, nc, "a", newMemSource())
	for _, body := range []string{``, `{`, `{"namespace":"m","key":"zz","max":1}`, `{"namespace":"","key":"aa","max":1}`, `{"namespace":"m","key":"aa","max":0}`, `{"namespace":"m","key":"aa","offset":-1,"max":5}`} {
		m, err := nc.Request(messages.NodeSubject("kvactors", "a", messages.NodeVerbFetch), []byte(body), 5*time.Second)
		require.NoError(t, err)
		require.NotEmpty(t, m.Header.Get(HeaderError), "%q", body)
		require.Empty(t, m.Data)
	}
}

// FetchAny skips a holder that is gone and one that serves corrupt bytes,
// and takes the chunk from the next; with no good holder, the error names
// every one.
func TestFetchAnyFallsBackToTheNextHolder(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	want := randomBytes(5, 1<<20+3)
	good := newMemSource()
	good.put("m", "k", want)
	serve(t, nc, "good", good)
	serve(t, nc, "rotten", ChunkSourceFunc(func(string, messages.Key) ([]byte, uint32, error) {
		bad := bytes.Clone(want)
		bad[0] ^= 1
		return bad, CRC32C(want), nil
	}))
	f := fetcher(t, testkit.Connect(t, s), nil) // "gone" answers at once: no responders
	allocs := 0
	alloc := func(n int64) ([]byte, error) { allocs++; return make([]byte, n), nil }
	got, from, err := f.FetchAny(ctxT(t), []string{"gone", "rotten", "good"}, "m", "k", alloc)
	require.NoError(t, err)
	require.Equal(t, "good", from)
	require.True(t, bytes.Equal(want, got))
	require.Equal(t, 2, allocs, "no buffer for the holder that is gone")

	_, _, err = f.FetchAny(ctxT(t), []string{"gone", "rotten"}, "m", "k", alloc)
	require.ErrorIs(t, err, ErrPiece)
	require.ErrorIs(t, err, ErrCorrupt)
	require.ErrorContains(t, err, "node gone")
	require.ErrorContains(t, err, "node rotten")
	_, _, err = f.FetchAny(ctxT(t), nil, "m", "k", alloc)
	require.ErrorIs(t, err, ErrRefused)

	// A buffer of the wrong size is refused, not overrun.
	_, err = f.FetchTo(ctxT(t), "good", "m", "k", func(n int64) ([]byte, error) { return make([]byte, n-1), nil })
	require.ErrorContains(t, err, "buffer of")
}
