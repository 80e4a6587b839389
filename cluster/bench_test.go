package cluster

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// benchSizes are chunk sizes: under one piece, about one piece (the default
// max_payload is 1 MiB), and the multi-piece sizes of real chunks.
var benchSizes = []int{256 << 10, 1000 << 10, 4 << 20, 16 << 20}

// BenchmarkFetchAcrossServers measures chunk fetch throughput between two
// clients on different servers of a 3-server cluster, beside a raw NATS
// request/reply loop moving the same bytes in pieces of the same size
// (no checksum, no headers, one piece in flight), in the same run. Run:
//
//	go test ./cluster -run '^$' -bench FetchAcrossServers -benchtime 40x
func BenchmarkFetchAcrossServers(b *testing.B) {
	c := testkit.NATSCluster(b, 3)
	server, client := c.Connect(0), c.Connect(2)
	src := newMemSource()
	for _, n := range benchSizes {
		src.put("m", messages.Key(fmt.Sprint(n)), randomBytes(uint64(n), n))
	}
	sub, err := ServeFetch(server, "kvactors", "a", src, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	piece := int(server.MaxPayload() - messages.HeaderRoom)
	raw := randomBytes(1, piece)
	rawSub, err := server.Subscribe("bench.raw", func(m *nats.Msg) {
		var want int
		_, _ = fmt.Sscan(string(m.Data), &want)
		_ = m.Respond(raw[:want])
	})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = rawSub.Unsubscribe() }()
	if err := server.Flush(); err != nil {
		b.Fatal(err)
	}
	// Wait for the subscriptions' interest to cross the routes.
	testkit.Eventually(b, 5*time.Second, 20*time.Millisecond, func() error {
		if _, err := client.Request("bench.raw", []byte("1"), time.Second); err != nil {
			return err
		}
		_, err := client.Request(messages.NodeSubject("kvactors", "a", messages.NodeVerbFetch), []byte(`{}`), time.Second)
		return err
	})

	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("raw/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(n))
			buf := make([]byte, n)
			for b.Loop() {
				for off := 0; off < n; off += piece {
					want := min(piece, n-off)
					m, err := client.Request("bench.raw", []byte(fmt.Sprint(want)), 5*time.Second)
					if err != nil || len(m.Data) != want {
						b.Fatalf("raw piece at %d: %v (%d bytes)", off, err, len(m.Data))
					}
					copy(buf[off:], m.Data)
				}
			}
		})
		for _, window := range []int{1, 4} {
			f, err := NewFetcher(client, Config{FetchWindow: window}, nil)
			if err != nil {
				b.Fatal(err)
			}
			b.Run(fmt.Sprintf("fetch-window%d/%dKiB", window, n>>10), func(b *testing.B) {
				b.SetBytes(int64(n))
				for b.Loop() {
					got, err := f.Fetch(context.Background(), "a", "m", messages.Key(fmt.Sprint(n)))
					if err != nil || len(got) != n {
						b.Fatalf("fetch: %v (%d bytes)", err, len(got))
					}
				}
			})
		}
	}
}
