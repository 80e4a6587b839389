package disk

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
)

// Record layout (little endian):
//
//	magic "KVD1" | key length u32 | data size u64 | data crc32c u32 | key | header crc32c u32 | data
//
// The header checksum covers everything before it.
//
// A tombstone says a record was dropped (evicted past the budget, or
// dropped by a read or Drop) while its bytes stay in their segment, so the
// rebuild does not bring it back: the same layout with its own magic, the
// record's data offset in place of the size and its segment id in place of
// the data checksum, and no data. It names the record, not the key, so a
// record of the key written after the dropped one stays live whatever the
// order their records and the tombstone reach the files.
//
//	magic "KVT1" | key length u32 | data offset u64 | segment id u32 | key | header crc32c u32
const (
	magic          = "KVD1"
	tombstoneMagic = "KVT1"
)

const fixedHeader = 4 + 4 + 8 + 4

// maxKeyLen is the longest key a record holds: the writer refuses a longer
// one (Spill) and the rebuild takes a longer key length for a torn header,
// so the two must share it, or a record written is cut at the next open
// with every record after it in its segment.
const maxKeyLen = 4096

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrBadRecord means a file is not a whole, intact record.
var ErrBadRecord = errors.New("disk: bad record")

// appendHeader appends a record's header to b.
func appendHeader(b []byte, key string, size int64, sum uint32) []byte {
	start := len(b)
	b = append(b, magic...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(key)))
	b = binary.LittleEndian.AppendUint64(b, uint64(size))
	b = binary.LittleEndian.AppendUint32(b, sum)
	b = append(b, key...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b[start:], castagnoli))
}

// appendTombstone appends the tombstone of key's record whose data lies at
// off in segment seg to b.
func appendTombstone(b []byte, key string, seg int, off int64) []byte {
	start := len(b)
	b = append(b, tombstoneMagic...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(key)))
	b = binary.LittleEndian.AppendUint64(b, uint64(off))
	b = binary.LittleEndian.AppendUint32(b, uint32(seg))
	b = append(b, key...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b[start:], castagnoli))
}

// header is a record's parsed header, or a tombstone's.
type header struct {
	key  string
	size int64
	sum  uint32
	len  int // bytes before the data
	// tombstone: the record of key at data offset off in segment seg is
	// dropped (size and sum are zero: a tombstone has no data).
	tombstone bool
	seg       int
	off       int64
}

// errEOF is a clean end: no byte of a next record.
var errEOF = errors.New("disk: end of segment")

// readHeader reads and checks a record's header.
func readHeader(r io.Reader) (header, error) {
	fixed := make([]byte, fixedHeader)
	if n, err := io.ReadFull(r, fixed); err != nil {
		if n == 0 && errors.Is(err, io.EOF) {
			return header{}, errEOF
		}
		return header{}, fmt.Errorf("%w: header: %v", ErrBadRecord, err)
	}
	tombstone := string(fixed[:4]) == tombstoneMagic
	if string(fixed[:4]) != magic && !tombstone {
		return header{}, fmt.Errorf("%w: magic %q", ErrBadRecord, fixed[:4])
	}
	klen := binary.LittleEndian.Uint32(fixed[4:])
	if klen > maxKeyLen {
		return header{}, fmt.Errorf("%w: key length %d", ErrBadRecord, klen)
	}
	rest := make([]byte, int(klen)+4)
	if _, err := io.ReadFull(r, rest); err != nil {
		return header{}, fmt.Errorf("%w: header: %v", ErrBadRecord, err)
	}
	want := binary.LittleEndian.Uint32(rest[klen:])
	got := crc32.Update(crc32.Checksum(fixed, castagnoli), castagnoli, rest[:klen])
	if got != want {
		return header{}, fmt.Errorf("%w: header checksum", ErrBadRecord)
	}
	h := header{key: string(rest[:klen]), size: int64(binary.LittleEndian.Uint64(fixed[8:])),
		sum: binary.LittleEndian.Uint32(fixed[16:]), len: fixedHeader + int(klen) + 4}
	if tombstone {
		h.tombstone, h.seg, h.off, h.size, h.sum = true, int(h.sum), h.size, 0, 0
	}
	if h.size < 0 || h.off < 0 {
		return header{}, fmt.Errorf("%w: size %d", ErrBadRecord, h.size)
	}
	return h, nil
}
