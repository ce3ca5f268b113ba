//go:build cgo && linux

package cheap

/*
#include <malloc.h>

static size_t cheap_free(void) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
	return mallinfo2().fordblks;
#elif defined(__GLIBC__)
	return (size_t)(unsigned int)mallinfo().fordblks;
#else
	return 0;
#endif
}

static void cheap_trim(void) {
#if defined(__GLIBC__)
	malloc_trim(0);
#endif
}
*/
import "C"

func trim() { C.cheap_trim() }

func free() int64 { return int64(C.cheap_free()) }
