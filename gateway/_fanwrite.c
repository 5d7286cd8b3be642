/* One frame to many sockets from Python, sent on a thread of its own (gateway/fanwrite.py says when the
 * scheduler uses it).
 *
 * Sender: `submit(fds, data)` queues the same bytes for every descriptor in the list and returns at once; the
 * sender's thread sends them (non-blocking, without the GIL) while the caller prepares the next ones (a
 * small job is left for `wait`). `wait()` sends what is still queued on the calling thread too, waits for the
 * rest and returns only the exceptions of everything submitted since the last wait: (index, sent) for each
 * socket that did not take the whole frame, indexed in the order of submission, where `sent` is the bytes it
 * took (0 up to len(data) - 1) or -errno when send failed. The caller hands the rest to that connection's
 * transport, which buffers it or reports the error as for its own write, and must not write to a submitted
 * socket any other way before `wait` returns. Nothing here owns a socket. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef MSG_NOSIGNAL /* macOS: SO_NOSIGPIPE is set per socket instead; the gateway ignores SIGPIPE anyway */
#define MSG_NOSIGNAL 0
#endif

typedef struct {
    Py_ssize_t index;
    Py_ssize_t sent; /* bytes taken, or -errno */
} Shortfall;

/* Send buf to each descriptor; record each that took less in short_of (index + base). Runs without the GIL. */
static Py_ssize_t send_all(const int *fds, Py_ssize_t count, const char *buf, size_t len, Shortfall *short_of,
                           Py_ssize_t base) {
    Py_ssize_t shortfalls = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        ssize_t n;
        if (fds[i] < 0) { /* passed over at submit (its transport closing or holding bytes): all of it is short */
            short_of[shortfalls].index = base + i;
            short_of[shortfalls].sent = 0;
            shortfalls++;
            continue;
        }
        do {
            n = send(fds[i], buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
        if (n != (ssize_t)len) {
            short_of[shortfalls].index = base + i;
            short_of[shortfalls].sent = n < 0 ? -(Py_ssize_t)errno : (Py_ssize_t)n;
            shortfalls++;
        }
    }
    return shortfalls;
}

/* The tuple's descriptors into fds (as many as it holds); -1 with an exception set on a bad one. A tuple,
 * not the caller's list: reading an item may run its `__index__`, which could shrink a list under us. */
static int read_fds(PyObject *fd_tuple, int *fds) {
    Py_ssize_t count = PyTuple_GET_SIZE(fd_tuple);
    for (Py_ssize_t i = 0; i < count; i++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(fd_tuple, i));
        if (fd == -1 && PyErr_Occurred())
            return -1;
        if (fd < 0 || fd > 0x7fffffffL) {
            PyErr_SetString(PyExc_ValueError, "a descriptor is out of range");
            return -1;
        }
        fds[i] = (int)fd;
    }
    return 0;
}

/* Pass over (fd -1) each socket whose transport is closing (its descriptor may be closed already, and its
 * number reused) or holds bytes not yet written (ours would overtake them): asked through the asyncio
 * transport's public methods, under the GIL. -1 with an exception set when a call fails. */
static int pass_over_busy(PyObject *transport_tuple, int *fds, Py_ssize_t count) {
    static PyObject *is_closing = NULL, *buffer_size = NULL;
    if (is_closing == NULL && (is_closing = PyUnicode_InternFromString("is_closing")) == NULL)
        return -1;
    if (buffer_size == NULL && (buffer_size = PyUnicode_InternFromString("get_write_buffer_size")) == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *transport = PyTuple_GET_ITEM(transport_tuple, i);
        PyObject *result = PyObject_CallMethodNoArgs(transport, is_closing);
        if (result == NULL)
            return -1;
        int busy = PyObject_IsTrue(result);
        Py_DECREF(result);
        if (busy == 0) {
            if ((result = PyObject_CallMethodNoArgs(transport, buffer_size)) == NULL)
                return -1;
            busy = PyObject_IsTrue(result);
            Py_DECREF(result);
        }
        if (busy < 0)
            return -1;
        if (busy)
            fds[i] = -1;
    }
    return 0;
}

/* -- Sender: the same sends on a thread of its own ------------------------------------------------------ */

/* Sockets in a job from which the sender's thread is woken for it (a crowd's slice); smaller jobs are
 * sent by `wait`. */
#define THREAD_MIN_SOCKETS 128

typedef struct Job {
    struct Job *next;
    int *fds;
    Py_ssize_t count;
    Py_ssize_t base;     /* index of its first socket among those submitted since the last wait */
    Py_buffer data;      /* released by `wait`, under the GIL */
    Shortfall *short_of; /* room for `count`: allocated at submit, so no thread allocates */
    Py_ssize_t shortfalls;
} Job;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t queued;  /* a job was queued, or the thread is told to stop */
    pthread_cond_t drained; /* the last job taken finished */
    Job *head, *tail;       /* queued, not yet taken */
    Job *taken;             /* taken (sent or being sent), newest first: `wait` reports and frees them */
    int sending;            /* jobs taken and not finished */
    Py_ssize_t submitted;   /* sockets submitted since the last wait */
    int started, stop;
    pid_t pid; /* the process that started the thread: a forked child has none and starts its own */
    pthread_t thread;
} Sender;

static void free_jobs(Job *job) {
    while (job != NULL) {
        Job *next = job->next;
        PyBuffer_Release(&job->data);
        PyMem_RawFree(job->fds);
        PyMem_RawFree(job->short_of);
        PyMem_RawFree(job);
        job = next;
    }
}

/* Take the next queued job and send it, the lock held on entry and on return; 0 when none was queued. */
static int send_next(Sender *self) {
    Job *job = self->head;
    if (job == NULL)
        return 0;
    self->head = job->next;
    if (self->head == NULL)
        self->tail = NULL;
    job->next = self->taken;
    self->taken = job;
    self->sending++;
    pthread_mutex_unlock(&self->lock);
    job->shortfalls = send_all(job->fds, job->count, job->data.buf, (size_t)job->data.len, job->short_of, job->base);
    pthread_mutex_lock(&self->lock);
    if (--self->sending == 0)
        pthread_cond_broadcast(&self->drained);
    return 1;
}

static void *sender_thread(void *arg) {
    Sender *self = arg;
    pthread_mutex_lock(&self->lock);
    while (!self->stop) {
        if (!send_next(self))
            pthread_cond_wait(&self->queued, &self->lock);
    }
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

static PyObject *sender_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":Sender", kwlist))
        return NULL;
    Sender *self = (Sender *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->queued, NULL);
    pthread_cond_init(&self->drained, NULL);
    return (PyObject *)self;
}

static PyObject *sender_submit(Sender *self, PyObject *args) {
    PyObject *fd_list, *transport_list = NULL;
    Job *job = PyMem_RawCalloc(1, sizeof(Job));
    if (job == NULL)
        return PyErr_NoMemory();
    if (!PyArg_ParseTuple(args, "O!y*|O!:submit", &PyList_Type, &fd_list, &job->data, &PyList_Type,
                          &transport_list)) {
        PyMem_RawFree(job);
        return NULL;
    }
    /* the descriptors the list holds now, in a tuple that holds its own references: what the items' code
     * does to the list while they are read changes nothing here */
    PyObject *fd_tuple = PyList_AsTuple(fd_list);
    if (fd_tuple == NULL) {
        free_jobs(job);
        return NULL;
    }
    job->count = PyTuple_GET_SIZE(fd_tuple);
    size_t room = (size_t)(job->count > 0 ? job->count : 1);
    job->fds = PyMem_RawMalloc(room * sizeof(int));
    job->short_of = PyMem_RawMalloc(room * sizeof(Shortfall));
    int read = job->fds != NULL && job->short_of != NULL ? read_fds(fd_tuple, job->fds) : -1;
    Py_DECREF(fd_tuple);
    if (read == 0 && transport_list != NULL) {
        PyObject *transport_tuple = PyList_AsTuple(transport_list);
        if (transport_tuple == NULL)
            read = -1;
        else if (PyTuple_GET_SIZE(transport_tuple) != job->count) {
            PyErr_SetString(PyExc_ValueError, "one transport per descriptor");
            read = -1;
        } else
            read = pass_over_busy(transport_tuple, job->fds, job->count);
        Py_XDECREF(transport_tuple);
    }
    if (read < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        free_jobs(job);
        return NULL;
    }
    if (self->started && self->pid != getpid()) { /* forked: the thread and the lock's state stayed behind */
        self->started = 0;
        pthread_mutex_init(&self->lock, NULL);
        pthread_cond_init(&self->queued, NULL);
        pthread_cond_init(&self->drained, NULL);
    }
    job->base = self->submitted;
    self->submitted += job->count;
    pthread_mutex_lock(&self->lock);
    if (self->tail == NULL)
        self->head = job;
    else
        self->tail->next = job;
    self->tail = job;
    pthread_mutex_unlock(&self->lock);
    /* A small job stays for `wait` to send on the caller's thread. Waking the thread for it costs more than
     * it saves, and `wait` would then depend on a thread that another process may have preempted: one such
     * wait per cycle, at many cycles a second, shows in the tail of every client's latency. */
    if (job->count < THREAD_MIN_SOCKETS)
        Py_RETURN_NONE;
    if (!self->started && pthread_create(&self->thread, NULL, sender_thread, self) == 0) {
        self->started = 1; /* else `wait` sends everything on the caller's thread */
        self->pid = getpid();
    }
    pthread_mutex_lock(&self->lock);
    pthread_cond_signal(&self->queued);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *sender_wait(Sender *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    while (send_next(self)) /* what is still queued goes out from this thread too */
        ;
    while (self->sending > 0)
        pthread_cond_wait(&self->drained, &self->lock);
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    Job *taken = self->taken;
    self->taken = NULL;
    self->submitted = 0;
    Py_ssize_t shortfalls = 0;
    for (Job *job = taken; job != NULL; job = job->next)
        shortfalls += job->shortfalls;
    PyObject *result = PyList_New(shortfalls);
    if (result != NULL) { /* in the order of submission: the list of taken jobs is newest first */
        Py_ssize_t k = shortfalls;
        for (Job *job = taken; job != NULL; job = job->next) {
            for (Py_ssize_t i = job->shortfalls - 1; i >= 0; i--) {
                PyObject *item = Py_BuildValue("(nn)", job->short_of[i].index, job->short_of[i].sent);
                if (item == NULL) {
                    Py_CLEAR(result);
                    break;
                }
                PyList_SET_ITEM(result, --k, item);
            }
            if (result == NULL)
                break;
        }
    }
    free_jobs(taken);
    return result;
}

static void sender_dealloc(Sender *self) {
    if (self->started && self->pid == getpid()) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->lock);
        self->stop = 1;
        pthread_cond_signal(&self->queued);
        pthread_mutex_unlock(&self->lock);
        pthread_join(self->thread, NULL);
        Py_END_ALLOW_THREADS
    }
    free_jobs(self->head); /* never waited for: only their memory is freed */
    free_jobs(self->taken);
    pthread_cond_destroy(&self->drained);
    pthread_cond_destroy(&self->queued);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef sender_methods[] = {
    {"submit", (PyCFunction)sender_submit, METH_VARARGS,
     "submit(fds: list[int], data: bytes, transports: list | None = None) -> None\n\nQueue data for each socket;"
     " the sender's thread sends it. With `transports` (one per socket), a socket whose transport is closing\n"
     "or holds unwritten bytes is passed over: reported by `wait` as taking 0 bytes."},
    {"wait", (PyCFunction)sender_wait, METH_NOARGS,
     "wait() -> list[tuple[int, int]]\n\nSend what is queued, wait for the rest; return (index, sent or -errno)\n"
     "for each socket submitted since the last wait that took less, indexed in the order of submission."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway._fanwrite.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sends submitted frames on a thread of its own; `wait` joins it.",
    .tp_new = sender_new,
    .tp_dealloc = (destructor)sender_dealloc,
    .tp_methods = sender_methods,
};

static PyMethodDef methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fanwrite", "One frame written to many sockets in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__fanwrite(void) {
    if (PyType_Ready(&SenderType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&SenderType);
    if (PyModule_AddObject(mod, "Sender", (PyObject *)&SenderType) < 0) {
        Py_DECREF(&SenderType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
