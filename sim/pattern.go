package sim

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math/rand/v2"
)

// HashBytes is the length of one block hash (a truncated sha256, like vLLM's
// 128-bit hash option).
const HashBytes = 16

// Hash is one request-level block hash.
type Hash [HashBytes]byte

// rootHash is the parent of a request's first hash block (vLLM's
// NONE_HASH). It is a constant, so the same tokens give the same hashes in
// every engine and every run.
var rootHash = Hash{'k', 'v', 'a', 'c', 't', 'o', 'r', 's', '-', 's', 'i', 'm'}

// ChainHash is the hash of one hash block: sha256 of the parent hash and the
// block's token ids (little-endian uint32), truncated. Chaining makes a hash
// name the whole prefix up to its block, as vLLM's block hashes do.
func ChainHash(parent Hash, tokens []uint32) Hash {
	h := sha256.New()
	h.Write(parent[:])
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], t)
		h.Write(b[:])
	}
	var sum [sha256.Size]byte
	var out Hash
	copy(out[:], h.Sum(sum[:0]))
	return out
}

// appendHashes extends hs with the hashes of every full hash block of tokens
// that hs does not cover yet.
func appendHashes(hs []Hash, tokens []uint32, tph int) []Hash {
	for n := len(hs); (n+1)*tph <= len(tokens); n++ {
		parent := rootHash
		if n > 0 {
			parent = hs[n-1]
		}
		hs = append(hs, ChainHash(parent, tokens[n*tph:(n+1)*tph]))
	}
	return hs
}

// KeyHex is the offload key of a chunk whose last hash block is h, in group
// g, as lowercase hex (PROTOCOL.md "Words": the hash, then g as 4 big-endian
// bytes).
func KeyHex(h Hash, g int) string {
	var k [HashBytes + 4]byte
	copy(k[:], h[:])
	binary.BigEndian.PutUint32(k[HashBytes:], uint32(g))
	return hex.EncodeToString(k[:])
}

// FillBlock writes the pattern of one GPU block region into dst: ChaCha8
// bytes seeded by the block's last hash (which names the token content up
// to the block's end), the group, the region and the block's position in
// the request. It never depends on the request id or the engine, so two
// requests or engines with the same prefix write the same bytes, which is
// what lets a chunk stored by one be checked against another's pattern.
func FillBlock(dst []byte, last Hash, group, region, block int) {
	var seed [HashBytes + 12]byte
	copy(seed[:], last[:])
	binary.LittleEndian.PutUint32(seed[HashBytes:], uint32(group))
	binary.LittleEndian.PutUint32(seed[HashBytes+4:], uint32(region))
	binary.LittleEndian.PutUint32(seed[HashBytes+8:], uint32(block))
	c := rand.NewChaCha8(sha256.Sum256(seed[:]))
	_, _ = c.Read(dst) // ChaCha8.Read never fails
}

// blockLastHash is the index of the last hash block inside GPU block b of a
// group with tpb tokens per block. Only a block whose tokens are all known
// has one.
func blockLastHash(b, tpb, tph int) int { return (b+1)*tpb/tph - 1 }

// splitmix64 derives independent seeds from (seed, stream) pairs, so each
// request's random choices depend only on Seed, the engine and its index.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func newRand(parts ...uint64) *rand.Rand {
	s := uint64(0x6b76616374657273) // "kvacters": any constant works
	for _, p := range parts {
		s = splitmix64(s ^ p)
	}
	return rand.New(rand.NewPCG(s, splitmix64(s)))
}

// stringSeed folds a string into a seed part.
func stringSeed(s string) uint64 {
	sum := sha256.Sum256([]byte(s))
	return binary.LittleEndian.Uint64(sum[:8])
}
