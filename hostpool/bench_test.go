package hostpool

import (
	"encoding/binary"
	"runtime"
	"testing"

	"github.com/kvactors/kvactors/messages"
)

// BenchmarkPrepareStoreChurn is the store-heavy bench's pool: 16 MiB of
// 256-byte chunks (65,536 keys of 40 bytes), full, each decision offering 5
// new keys that evict 5, then completing them. ns/op is one decision.
func BenchmarkPrepareStoreChurn(b *testing.B) {
	const chunk, perOffer = 256, 5
	p := New(16<<20, 0)
	key := func(i int) messages.Key {
		var k [40]byte
		binary.BigEndian.PutUint64(k[4:], uint64(i)*0x9e3779b97f4a7c15) // spread like content hashes
		binary.BigEndian.PutUint64(k[12:], uint64(i))
		return messages.Key(k[:])
	}
	sizes := []int64{chunk, chunk, chunk, chunk, chunk}
	keys := make([]messages.Key, perOffer)
	n := 0
	offer := func() {
		for j := range keys {
			keys[j] = key(n)
			n++
		}
		out, err := p.PrepareStore(keys, sizes)
		if err != nil {
			b.Fatal(err)
		}
		p.CompleteStore(out.Keys, make([]uint32, len(out.Keys)))
	}
	for p.Len() < 16<<20/chunk {
		offer()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		offer()
	}
}

// BenchmarkTinyChunksHeap offers 2M one-byte chunks (40-byte keys, 64 an
// offer, each completed) to a 1 GiB pool, uncapped and with the node's
// default cap (DefaultMaxChunks: 262,144), and reports the heap the pool
// holds after a GC: heap-MB in all, B/chunk per chunk held. Run with
// -benchtime=1x; the uncapped case is what an engine's one-byte chunks
// cost a node before the cap (~1G chunks fit a 1 GiB pool's bytes).
func BenchmarkTinyChunksHeap(b *testing.B) {
	const offered, perOffer = 2_000_000, 64
	for _, c := range []struct {
		name string
		max  int
	}{{"uncapped", MaxChunks}, {"default-cap", DefaultMaxChunks(1 << 30)}} {
		b.Run(c.name, func(b *testing.B) {
			for range b.N {
				var m0, m1 runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&m0)
				p := New(1<<30, 0)
				p.SetMaxChunks(c.max)
				keys := make([]messages.Key, perOffer)
				sizes := make([]int64, perOffer)
				sums := make([]uint32, perOffer)
				for i := range sizes {
					sizes[i] = 1
				}
				for n := 0; n < offered; n += perOffer {
					for j := range keys {
						var k [40]byte
						binary.BigEndian.PutUint64(k[4:], uint64(n+j)*0x9e3779b97f4a7c15)
						binary.BigEndian.PutUint64(k[12:], uint64(n+j))
						keys[j] = messages.Key(k[:])
					}
					out, err := p.PrepareStore(keys, sizes)
					if err != nil {
						b.Fatal(err)
					}
					p.CompleteStore(out.Keys, sums[:len(out.Keys)])
				}
				clear(keys)
				runtime.GC()
				runtime.ReadMemStats(&m1)
				heap := float64(m1.HeapAlloc) - float64(m0.HeapAlloc)
				b.ReportMetric(float64(p.Len()), "chunks")
				b.ReportMetric(heap/(1<<20), "heap-MB")
				b.ReportMetric(heap/float64(p.Len()), "B/chunk")
				runtime.KeepAlive(p)
			}
		})
	}
}
