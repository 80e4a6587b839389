package hostpool

import (
	"encoding/binary"
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
