/* Asynchronous file I/O for NVMe offload: a pool of threads doing pread/pwrite.
 *
 * A request (one buffer, one file range) is cut into blocks of `block` bytes that the
 * workers serve in parallel (DeepSpeed's aio `block_size` and `thread_count`); the
 * caller gets a ticket at once and waits on it later, so reads of the next sub-group
 * and writes of the previous one run while the current one is updated. Works with
 * O_DIRECT descriptors when buffers, offsets and sizes are aligned (the Python side
 * arranges that) and with ordinary ones. Errors come back as errno from fz_aio_wait.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct fz_request {
    int64_t pending; /* blocks not done yet */
    int error;       /* first errno seen, 0 if none */
} fz_request;

typedef struct fz_task {
    fz_request *request;
    int fd;
    char *buf;
    int64_t nbytes;
    int64_t offset;
    int write;
} fz_task;

typedef struct fz_aio {
    pthread_mutex_t lock;
    pthread_cond_t work; /* a task was queued, or shutdown */
    pthread_cond_t done; /* a request finished a block */
    fz_task *tasks;      /* ring buffer */
    int64_t capacity, head, count;
    int stop;
    int threads;
    pthread_t *workers;
} fz_aio;

static int fz_transfer(const fz_task *t) {
    int64_t moved = 0;
    while (moved < t->nbytes) {
        ssize_t n = t->write ? pwrite(t->fd, t->buf + moved, (size_t)(t->nbytes - moved), t->offset + moved)
                             : pread(t->fd, t->buf + moved, (size_t)(t->nbytes - moved), t->offset + moved);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) return t->write ? EIO : ENODATA; /* short file */
        moved += n;
    }
    return 0;
}

static void *fz_worker(void *arg) {
    fz_aio *q = (fz_aio *)arg;
    for (;;) {
        pthread_mutex_lock(&q->lock);
        while (q->count == 0 && !q->stop) pthread_cond_wait(&q->work, &q->lock);
        if (q->count == 0 && q->stop) {
            pthread_mutex_unlock(&q->lock);
            return NULL;
        }
        fz_task task = q->tasks[q->head];
        q->head = (q->head + 1) % q->capacity;
        q->count--;
        pthread_mutex_unlock(&q->lock);
        const int error = fz_transfer(&task);
        pthread_mutex_lock(&q->lock);
        if (error && !task.request->error) task.request->error = error;
        task.request->pending--;
        pthread_cond_broadcast(&q->done);
        pthread_mutex_unlock(&q->lock);
    }
}

fz_aio *fz_aio_new(int threads) {
    fz_aio *q = calloc(1, sizeof(fz_aio));
    if (!q) return NULL;
    q->threads = threads < 1 ? 1 : threads;
    q->capacity = 1024;
    q->tasks = calloc((size_t)q->capacity, sizeof(fz_task));
    q->workers = calloc((size_t)q->threads, sizeof(pthread_t));
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->done, NULL);
    for (int i = 0; i < q->threads; i++) pthread_create(&q->workers[i], NULL, fz_worker, q);
    return q;
}

static void fz_grow(fz_aio *q) {
    fz_task *bigger = calloc((size_t)(2 * q->capacity), sizeof(fz_task));
    for (int64_t i = 0; i < q->count; i++) bigger[i] = q->tasks[(q->head + i) % q->capacity];
    free(q->tasks);
    q->tasks = bigger;
    q->head = 0;
    q->capacity *= 2;
}

/* Queue a read (write=0) or write of `nbytes` at `offset`; returns a ticket for
 * fz_aio_wait, or 0 when out of memory. */
int64_t fz_aio_submit(fz_aio *q, int fd, void *buf, int64_t nbytes, int64_t offset, int write,
                      int64_t block) {
    fz_request *r = calloc(1, sizeof(fz_request));
    if (!r) return 0;
    if (block <= 0) block = nbytes > 0 ? nbytes : 1;
    pthread_mutex_lock(&q->lock);
    for (int64_t at = 0; at < nbytes; at += block) {
        if (q->count == q->capacity) fz_grow(q);
        fz_task *t = &q->tasks[(q->head + q->count) % q->capacity];
        t->request = r;
        t->fd = fd;
        t->buf = (char *)buf + at;
        t->nbytes = nbytes - at < block ? nbytes - at : block;
        t->offset = offset + at;
        t->write = write;
        q->count++;
        r->pending++;
    }
    pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->lock);
    return (int64_t)(intptr_t)r;
}

/* Block until the request is done; returns 0 or the first errno. Frees the ticket. */
int fz_aio_wait(fz_aio *q, int64_t ticket) {
    fz_request *r = (fz_request *)(intptr_t)ticket;
    pthread_mutex_lock(&q->lock);
    while (r->pending > 0) pthread_cond_wait(&q->done, &q->lock);
    pthread_mutex_unlock(&q->lock);
    const int error = r->error;
    free(r);
    return error;
}

void fz_aio_free(fz_aio *q) {
    if (!q) return;
    pthread_mutex_lock(&q->lock);
    q->stop = 1;
    pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->lock);
    for (int i = 0; i < q->threads; i++) pthread_join(q->workers[i], NULL);
    pthread_mutex_destroy(&q->lock);
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->done);
    free(q->tasks);
    free(q->workers);
    free(q);
}
