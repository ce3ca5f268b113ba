package mpk

import (
	"encoding/binary"
	"math"
	"time"
)

// AppendNil appends the MessagePack nil.
func AppendNil(dst []byte) []byte {
	return append(dst, 0xc0)
}

// AppendBool appends a MessagePack boolean.
func AppendBool(dst []byte, v bool) []byte {
	if v {
		return append(dst, 0xc3)
	}
	return append(dst, 0xc2)
}

// AppendInt appends v in its shortest encoding. Non-negative values use the
// unsigned forms, as vmihailenco/msgpack does with UseCompactInts.
func AppendInt(dst []byte, v int64) []byte {
	switch {
	case v >= 0:
		return AppendUint(dst, uint64(v))
	case v >= -32:
		return append(dst, byte(v))
	case v >= math.MinInt8:
		return append(dst, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(dst, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(dst, 0xd2), uint32(v))
	default:
		return binary.BigEndian.AppendUint64(append(dst, 0xd3), uint64(v))
	}
}

// AppendUint appends v in its shortest encoding.
func AppendUint(dst []byte, v uint64) []byte {
	switch {
	case v <= math.MaxInt8:
		return append(dst, byte(v))
	case v <= math.MaxUint8:
		return append(dst, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(dst, 0xce), uint32(v))
	default:
		return binary.BigEndian.AppendUint64(append(dst, 0xcf), v)
	}
}

// AppendFloat64 appends v as a MessagePack float64. NaN payloads and the
// sign of zero are preserved.
func AppendFloat64(dst []byte, v float64) []byte {
	return binary.BigEndian.AppendUint64(append(dst, 0xcb), math.Float64bits(v))
}

// AppendString appends s as a MessagePack string. It does not check that s
// is valid UTF-8.
func AppendString(dst []byte, s string) []byte {
	return append(appendStrHeader(dst, len(s)), s...)
}

// AppendStringBytes is AppendString for a byte slice.
func AppendStringBytes(dst []byte, s []byte) []byte {
	return append(appendStrHeader(dst, len(s)), s...)
}

// AppendBin appends b as MessagePack binary data.
func AppendBin(dst []byte, b []byte) []byte {
	n := checkLen(len(b))
	switch {
	case n <= math.MaxUint8:
		dst = append(dst, 0xc4, byte(n))
	case n <= math.MaxUint16:
		dst = binary.BigEndian.AppendUint16(append(dst, 0xc5), uint16(n))
	default:
		dst = binary.BigEndian.AppendUint32(append(dst, 0xc6), n)
	}
	return append(dst, b...)
}

// AppendArrayHeader appends the header of an array of n elements, which the
// caller then appends.
func AppendArrayHeader(dst []byte, n int) []byte {
	u := checkLen(n)
	switch {
	case u < 16:
		return append(dst, 0x90|byte(u))
	case u <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xdc), uint16(u))
	default:
		return binary.BigEndian.AppendUint32(append(dst, 0xdd), u)
	}
}

// AppendMapHeader appends the header of a map of n key-value pairs, which
// the caller then appends, key first.
func AppendMapHeader(dst []byte, n int) []byte {
	u := checkLen(n)
	switch {
	case u < 16:
		return append(dst, 0x80|byte(u))
	case u <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xde), uint16(u))
	default:
		return binary.BigEndian.AppendUint32(append(dst, 0xdf), u)
	}
}

// AppendTime appends t as a timestamp (extension type -1) in the shortest
// of the three forms the specification defines: 32-bit seconds when t is a
// whole second in [1970, 2106), 30-bit nanoseconds and 34-bit seconds when
// t is in [1970, 2514), and 32-bit nanoseconds with 64-bit signed seconds
// otherwise. The location of t is not encoded.
func AppendTime(dst []byte, t time.Time) []byte {
	return appendTimestamp(dst, t.Unix(), uint64(t.Nanosecond()))
}

// AppendUnixNano appends the time ns nanoseconds after the Unix epoch as AppendTime does
// time.Unix(0, ns), without making the time.Time.
func AppendUnixNano(dst []byte, ns int64) []byte {
	sec, nsec := ns/1e9, ns%1e9
	if nsec < 0 {
		sec, nsec = sec-1, nsec+1e9
	}
	return appendTimestamp(dst, sec, uint64(nsec))
}

// appendTimestamp appends the timestamp extension of sec seconds and nsec (below 1e9) nanoseconds
// after the Unix epoch, in its smallest form.
func appendTimestamp(dst []byte, sec int64, nsec uint64) []byte {
	if uint64(sec)>>34 == 0 {
		data := nsec<<34 | uint64(sec)
		if data>>32 == 0 {
			return binary.BigEndian.AppendUint32(append(dst, 0xd6, 0xff), uint32(data))
		}
		return binary.BigEndian.AppendUint64(append(dst, 0xd7, 0xff), data)
	}
	dst = binary.BigEndian.AppendUint32(append(dst, 0xc7, 12, 0xff), uint32(nsec))
	return binary.BigEndian.AppendUint64(dst, uint64(sec))
}

// AppendRFC3339Nano appends the time ns nanoseconds after the Unix epoch, in UTC, as
// time.Unix(0, ns).UTC().AppendFormat(dst, time.RFC3339Nano) does, without the general formatter.
func AppendRFC3339Nano(dst []byte, ns int64) []byte {
	if ns < 0 {
		return time.Unix(0, ns).UTC().AppendFormat(dst, time.RFC3339Nano)
	}
	sec, nsec := ns/1e9, ns%1e9
	days, rem := sec/86400, sec%86400
	// Civil date from days since 1970-01-01 (Howard Hinnant's days_from_civil, inverted).
	z := days + 719468
	era := z / 146097
	doe := z - era*146097
	yoe := (doe - doe/1460 + doe/36524 - doe/146096) / 365
	y := yoe + era*400
	doy := doe - (365*yoe + yoe/4 - yoe/100)
	mp := (5*doy + 2) / 153
	d := doy - (153*mp+2)/5 + 1
	m := mp + 3
	if m > 12 {
		m -= 12
	}
	if m <= 2 {
		y++
	}
	dst = append(dst, byte('0'+y/1000), byte('0'+y/100%10), byte('0'+y/10%10), byte('0'+y%10), '-',
		byte('0'+m/10), byte('0'+m%10), '-', byte('0'+d/10), byte('0'+d%10), 'T',
		byte('0'+rem/36000), byte('0'+rem/3600%10), ':', byte('0'+rem/600%6), byte('0'+rem/60%10), ':',
		byte('0'+rem%60/10), byte('0'+rem%10))
	if nsec != 0 {
		var f [10]byte
		f[0] = '.'
		for i := 9; i >= 1; i-- {
			f[i] = byte('0' + nsec%10)
			nsec /= 10
		}
		n := 10
		for f[n-1] == '0' {
			n--
		}
		dst = append(dst, f[:n]...)
	}
	return append(dst, 'Z')
}

func appendStrHeader(dst []byte, n int) []byte {
	u := checkLen(n)
	switch {
	case u < 32:
		return append(dst, 0xa0|byte(u))
	case u <= math.MaxUint8:
		return append(dst, 0xd9, byte(u))
	case u <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xda), uint16(u))
	default:
		return binary.BigEndian.AppendUint32(append(dst, 0xdb), u)
	}
}

// checkLen panics if n cannot be a MessagePack length or count.
func checkLen(n int) uint32 {
	if n < 0 || uint64(n) > math.MaxUint32 {
		panic("mpk: length out of range")
	}
	return uint32(n)
}
