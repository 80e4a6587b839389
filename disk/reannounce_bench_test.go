package disk

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// ReannouncePrefix over a large index, and the longest a Has (a lookup of
// the tier) waits on the tier's lock meanwhile:
//
//	go test -run '^$' -bench ReannouncePrefix -benchtime 20x ./disk
//
// The index holds 1M chunks of 100 namespaces (node-shaped disk keys:
// namespace name and geometry, hash, group), interleaved as the stores of
// several tenants leave them; an op of /namespace tells one namespace's
// (10k chunks), of /all every chunk (Reannounce). The records are indexed,
// not written: the walk reads no byte.
func BenchmarkReannouncePrefix(b *testing.B) {
	const chunks, namespaces = 1 << 20, 100
	d, err := Open(Config{Dir: b.TempDir(), Bytes: 1 << 50}, func(string, []messages.Key, []messages.Key) {})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	prefix := func(ns int) string {
		name := fmt.Sprintf("tenant-%03d", ns)
		p := binary.AppendUvarint(nil, uint64(len(name)))
		p = append(p, name...)
		return string(binary.BigEndian.AppendUint64(p, 0x9e3779b97f4a7c15))
	}
	d.mu.Lock()
	seg := d.segs[len(d.segs)-1]
	for i := range chunks {
		k := binary.BigEndian.AppendUint64([]byte(prefix(i%namespaces)), uint64(i))
		k = binary.BigEndian.AppendUint32(k, 0)
		d.index(&item{key: messages.Key(k), seg: seg, off: int64(i) * 64, size: 16, engine: "e"})
	}
	d.mu.Unlock()
	probe := d.Keys()[0]
	for _, all := range []bool{false, true} {
		b.Run(map[bool]string{false: "namespace", true: "all"}[all], func(b *testing.B) {
			var worst atomic.Int64
			stop, done := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(done)
				for {
					select {
					case <-stop:
						return
					default:
					}
					t := time.Now()
					d.Has(probe)
					if w := int64(time.Since(t)); w > worst.Load() {
						worst.Store(w)
					}
				}
			}()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if all {
					d.Reannounce()
				} else {
					d.ReannouncePrefix(prefix(i%namespaces), nil)
				}
			}
			b.StopTimer()
			close(stop)
			<-done
			b.ReportMetric(float64(worst.Load())/1e6, "max-Has-wait-ms")
		})
	}
}
