/* One frame to many sockets in one call from Python (gateway/fanwrite.py says when the scheduler uses it).
 *
 * send_each(fds, data) sends the same bytes to every descriptor in the list, non-blocking, without the
 * GIL, and returns only the exceptions: a list of (index, sent) for each socket that did not take the
 * whole frame, where `sent` is the bytes it took (0 up to len(data) - 1) or -errno when send failed. The
 * caller hands the rest to that connection's transport, which buffers it or reports the error as it would
 * for its own write. Nothing here owns a socket or keeps state between calls. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/types.h>

#ifndef MSG_NOSIGNAL /* macOS: SO_NOSIGPIPE is set per socket instead; the gateway ignores SIGPIPE anyway */
#define MSG_NOSIGNAL 0
#endif

typedef struct {
    Py_ssize_t index;
    Py_ssize_t sent; /* bytes taken, or -errno */
} Shortfall;

static PyObject *send_each(PyObject *self, PyObject *args) {
    PyObject *fd_list;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "O!y*:send_each", &PyList_Type, &fd_list, &data))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(fd_list);
    int *fds = NULL;
    Shortfall *short_of = NULL;
    PyObject *result = NULL;
    if (count > 0) {
        fds = PyMem_RawMalloc((size_t)count * sizeof(int));
        short_of = PyMem_RawMalloc((size_t)count * sizeof(Shortfall));
        if (fds == NULL || short_of == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long fd = PyLong_AsLong(PyList_GET_ITEM(fd_list, i));
        if (fd == -1 && PyErr_Occurred())
            goto done;
        if (fd < 0 || fd > 0x7fffffffL) {
            PyErr_SetString(PyExc_ValueError, "send_each: a descriptor is out of range");
            goto done;
        }
        fds[i] = (int)fd;
    }
    Py_ssize_t shortfalls = 0;
    const char *buf = data.buf;
    size_t len = (size_t)data.len;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        ssize_t n;
        do {
            n = send(fds[i], buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
        if (n != (ssize_t)len) {
            short_of[shortfalls].index = i;
            short_of[shortfalls].sent = n < 0 ? -(Py_ssize_t)errno : (Py_ssize_t)n;
            shortfalls++;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(shortfalls);
    if (result == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < shortfalls; k++) {
        PyObject *item = Py_BuildValue("(nn)", short_of[k].index, short_of[k].sent);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, item);
    }
done:
    PyMem_RawFree(fds);
    PyMem_RawFree(short_of);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"send_each", send_each, METH_VARARGS,
     "send_each(fds: list[int], data: bytes) -> list[tuple[int, int]]\n\n"
     "Send data to each socket (non-blocking); return (index, sent or -errno) for each that took less."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fanwrite", "One frame written to many sockets in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__fanwrite(void) { return PyModule_Create(&module); }
