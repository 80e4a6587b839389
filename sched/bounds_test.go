package sched_test

import (
	"testing"
	"testing/quick"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// The engine SDK refuses an event past ingest.RequestBounds before sending
// it; the scheduler rejects one past its layout's bounds (too_large). They
// must be the same bounds, or the SDK would refuse what the node takes or
// send what it rejects.
func TestTheSDKsRequestBoundsAreTheLayouts(t *testing.T) {
	f := func(tph, bpc uint8, blocks uint32, mml uint32, tpbs []uint8) bool {
		spec := messages.EngineSpec{TokensPerHash: int(tph%64) + 1, BlocksPerChunk: int(bpc%8) + 1,
			NumGPUBlocks: int(blocks%(1<<31)) + 1, MaxModelLen: int(mml % (1 << 30)),
			Segments: []messages.Segment{{Shm: "e1-kv"}}}
		if len(tpbs) == 0 {
			tpbs = []uint8{0}
		}
		for _, tpb := range tpbs[:min(len(tpbs), 4)] {
			g := messages.GroupSpec{Kind: messages.KindFull, TokensPerBlock: spec.TokensPerHash * (int(tpb%4) + 1),
				Regions: []messages.Region{{BlockStride: 64, BlockBytes: 64}}}
			spec.Groups = append(spec.Groups, g)
		}
		lay, err := sched.NewLayout(&spec)
		if err != nil {
			t.Logf("spec refused: %v", err)
			return false
		}
		hashes, groups := ingest.RequestBounds(&spec)
		if hashes != lay.MaxHashes || len(groups) != len(lay.Groups) {
			return false
		}
		for g := range groups {
			if groups[g] != lay.Groups[g].MaxBlocks {
				return false
			}
		}
		return true
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 3000}); err != nil {
		t.Fatal(err)
	}
}
