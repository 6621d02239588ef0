/*
 * A Vulkan driver (ICD) in front of Mesa's RADV for its "null" device (RADV_FORCE_FAMILY=navi31
 * etc., no AMD hardware): the real binary then builds every pipeline as it would on that GPU,
 * and RADV_DEBUG=shaderstats,asm prints what ACO made of each (registers, spills, scratch,
 * occupancy, machine code). Used by scripts/gpu-compiler-report.sh; never by the program.
 *
 * The null device cannot run anything, and two things stop wgpu before it builds a pipeline:
 * it creates a timeline semaphore, which the null device refuses, and the device reports no
 * memory type. So this shim forwards everything to RADV (TORUS_RADV_LIBRARY: its .so) except:
 * the timelineSemaphore feature is hidden; one host-backed, device-local heap is reported and
 * memory is malloc'ed and mapped here (binding it is a no-op); fences and semaphores are
 * handles of ours that are always signalled; submissions, waits, descriptor updates and every
 * recorded command (vkCmd*) do nothing; query results read as zeros. Shader compilation
 * (vkCreateShaderModule, vkCreateComputePipelines) is RADV's own.
 *
 * Build: cc -shared -fPIC -O2 -o libtorus_radv_shim.so shim.c -ldl (with Vulkan's headers,
 * Debian's libvulkan-dev).
 */
#define VK_NO_PROTOTYPES
#include <vulkan/vulkan.h>
#include <vulkan/vk_icd.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static void *radv;
static PFN_vkGetInstanceProcAddr radv_gipa;
static PFN_vkVoidFunction (*radv_gpdpa)(VkInstance, const char *);
static VkResult (*radv_negotiate)(uint32_t *);
static PFN_vkGetDeviceProcAddr radv_gdpa;

static void load(void) {
    if (radv) return;
    const char *path = getenv("TORUS_RADV_LIBRARY");
    radv = dlopen(path ? path : "libvulkan_radeon.so", RTLD_NOW | RTLD_LOCAL);
    if (!radv) { fprintf(stderr, "radv-shim: %s\n", dlerror()); abort(); }
    radv_gipa = (PFN_vkGetInstanceProcAddr)dlsym(radv, "vk_icdGetInstanceProcAddr");
    radv_gpdpa = (PFN_vkVoidFunction(*)(VkInstance, const char *))dlsym(radv, "vk_icdGetPhysicalDeviceProcAddr");
    radv_negotiate = (VkResult(*)(uint32_t *))dlsym(radv, "vk_icdNegotiateLoaderICDInterfaceVersion");
}

/* ---- instance level ---- */
static PFN_vkGetPhysicalDeviceFeatures2 real_features2;
static PFN_vkCreateDevice real_create_device;

static void hide_timeline(void *chain) {
    for (VkBaseOutStructure *s = chain; s; s = s->pNext) {
        if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES)
            ((VkPhysicalDeviceVulkan12Features *)s)->timelineSemaphore = VK_FALSE;
        if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES)
            ((VkPhysicalDeviceTimelineSemaphoreFeatures *)s)->timelineSemaphore = VK_FALSE;
    }
}

static VKAPI_ATTR void VKAPI_CALL features2(VkPhysicalDevice pd, VkPhysicalDeviceFeatures2 *f) {
    real_features2(pd, f);
    hide_timeline(f->pNext);
}

static void one_heap(VkPhysicalDeviceMemoryProperties *p) {
    memset(p, 0, sizeof *p);
    p->memoryTypeCount = 1;
    p->memoryTypes[0].propertyFlags = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT |
                                      VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    p->memoryTypes[0].heapIndex = 0;
    p->memoryHeapCount = 1;
    p->memoryHeaps[0].size = 64ull << 30;
    p->memoryHeaps[0].flags = VK_MEMORY_HEAP_DEVICE_LOCAL_BIT;
}

static VKAPI_ATTR void VKAPI_CALL memory_properties(VkPhysicalDevice pd, VkPhysicalDeviceMemoryProperties *p) {
    (void)pd;
    one_heap(p);
}

static VKAPI_ATTR void VKAPI_CALL memory_properties2(VkPhysicalDevice pd, VkPhysicalDeviceMemoryProperties2 *p) {
    (void)pd;
    one_heap(&p->memoryProperties);
    for (VkBaseOutStructure *s = p->pNext; s; s = s->pNext) {
        if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT) {
            VkPhysicalDeviceMemoryBudgetPropertiesEXT *b = (void *)s;
            b->heapBudget[0] = 64ull << 30;
            b->heapUsage[0] = 0;
        }
    }
}

static VKAPI_ATTR VkResult VKAPI_CALL create_device(VkPhysicalDevice pd, const VkDeviceCreateInfo *ci,
                                                   const VkAllocationCallbacks *a, VkDevice *d) {
    hide_timeline((void *)ci->pNext);
    return real_create_device(pd, ci, a, d);
}

/* ---- device level ---- */
typedef struct { void *p; VkDeviceSize size; } Memory;
static PFN_vkGetBufferMemoryRequirements real_buffer_reqs;
static PFN_vkGetBufferMemoryRequirements2 real_buffer_reqs2;
static PFN_vkGetImageMemoryRequirements real_image_reqs;
static PFN_vkGetImageMemoryRequirements2 real_image_reqs2;
static uint64_t next_handle = 0x1000;

static VKAPI_ATTR VkResult VKAPI_CALL allocate_memory(VkDevice d, const VkMemoryAllocateInfo *i,
                                                     const VkAllocationCallbacks *a, VkDeviceMemory *m) {
    (void)d; (void)a;
    Memory *mem = calloc(1, sizeof *mem);
    if (!mem) return VK_ERROR_OUT_OF_HOST_MEMORY;
    mem->size = i->allocationSize;
    if (posix_memalign(&mem->p, 4096, i->allocationSize ? i->allocationSize : 1)) { free(mem); return VK_ERROR_OUT_OF_HOST_MEMORY; }
    *m = (VkDeviceMemory)(uintptr_t)mem;
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL free_memory(VkDevice d, VkDeviceMemory m, const VkAllocationCallbacks *a) {
    (void)d; (void)a;
    Memory *mem = (Memory *)(uintptr_t)m;
    if (mem) { free(mem->p); free(mem); }
}

static VKAPI_ATTR VkResult VKAPI_CALL map_memory(VkDevice d, VkDeviceMemory m, VkDeviceSize off, VkDeviceSize size,
                                                VkMemoryMapFlags f, void **pp) {
    (void)d; (void)size; (void)f;
    *pp = (char *)((Memory *)(uintptr_t)m)->p + off;
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL buffer_reqs(VkDevice d, VkBuffer b, VkMemoryRequirements *r) {
    real_buffer_reqs(d, b, r);
    r->memoryTypeBits = 1;
}
static VKAPI_ATTR void VKAPI_CALL buffer_reqs2(VkDevice d, const VkBufferMemoryRequirementsInfo2 *i, VkMemoryRequirements2 *r) {
    real_buffer_reqs2(d, i, r);
    r->memoryRequirements.memoryTypeBits = 1;
}
static VKAPI_ATTR void VKAPI_CALL image_reqs(VkDevice d, VkImage im, VkMemoryRequirements *r) {
    real_image_reqs(d, im, r);
    r->memoryTypeBits = 1;
}
static VKAPI_ATTR void VKAPI_CALL image_reqs2(VkDevice d, const VkImageMemoryRequirementsInfo2 *i, VkMemoryRequirements2 *r) {
    real_image_reqs2(d, i, r);
    r->memoryRequirements.memoryTypeBits = 1;
}

static VKAPI_ATTR VkResult VKAPI_CALL create_fake(VkDevice d, const void *ci, const VkAllocationCallbacks *a, uint64_t *out) {
    (void)d; (void)ci; (void)a;
    *out = __atomic_add_fetch(&next_handle, 1, __ATOMIC_RELAXED);
    return VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL query_results(VkDevice d, VkQueryPool p, uint32_t first, uint32_t count, size_t size,
                                                   void *data, VkDeviceSize stride, VkQueryResultFlags f) {
    (void)d; (void)p; (void)first; (void)count; (void)stride; (void)f;
    memset(data, 0, size);
    return VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL counter_value(VkDevice d, VkSemaphore s, uint64_t *v) {
    (void)d; (void)s;
    *v = UINT64_MAX / 2;
    return VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL success(void) { return VK_SUCCESS; }
static VKAPI_ATTR void VKAPI_CALL nothing(void) {}

/* Names answered here; `real` (when not NULL) receives the driver's function. */
static PFN_vkVoidFunction intercept(const char *n, PFN_vkVoidFunction (*lookup)(const char *)) {
#define WRAP(name, ours, real)                                                    \
    if (!strcmp(n, name)) {                                                       \
        PFN_vkVoidFunction f = lookup(name);                                      \
        memcpy(&(real), &f, sizeof f);                                            \
        return (PFN_vkVoidFunction)(ours);                                        \
    }
#define OWN(name, ours)                                                           \
    if (!strcmp(n, name)) return (PFN_vkVoidFunction)(ours);
    WRAP("vkGetPhysicalDeviceFeatures2", features2, real_features2)
    WRAP("vkGetPhysicalDeviceFeatures2KHR", features2, real_features2)
    OWN("vkGetPhysicalDeviceMemoryProperties", memory_properties)
    OWN("vkGetPhysicalDeviceMemoryProperties2", memory_properties2)
    OWN("vkGetPhysicalDeviceMemoryProperties2KHR", memory_properties2)
    WRAP("vkCreateDevice", create_device, real_create_device)
    OWN("vkAllocateMemory", allocate_memory)
    OWN("vkFreeMemory", free_memory)
    OWN("vkMapMemory", map_memory)
    WRAP("vkGetBufferMemoryRequirements", buffer_reqs, real_buffer_reqs)
    WRAP("vkGetBufferMemoryRequirements2", buffer_reqs2, real_buffer_reqs2)
    WRAP("vkGetBufferMemoryRequirements2KHR", buffer_reqs2, real_buffer_reqs2)
    WRAP("vkGetImageMemoryRequirements", image_reqs, real_image_reqs)
    WRAP("vkGetImageMemoryRequirements2", image_reqs2, real_image_reqs2)
    WRAP("vkGetImageMemoryRequirements2KHR", image_reqs2, real_image_reqs2)
    OWN("vkCreateFence", create_fake)
    OWN("vkCreateSemaphore", create_fake)
    OWN("vkCreateEvent", create_fake)
    OWN("vkGetQueryPoolResults", query_results)
    OWN("vkGetSemaphoreCounterValue", counter_value)
    OWN("vkGetSemaphoreCounterValueKHR", counter_value)
    static const char *ok[] = {"vkUnmapMemory", "vkFlushMappedMemoryRanges", "vkInvalidateMappedMemoryRanges",
        "vkBindBufferMemory", "vkBindBufferMemory2", "vkBindBufferMemory2KHR", "vkBindImageMemory",
        "vkBindImageMemory2", "vkBindImageMemory2KHR", "vkQueueSubmit", "vkQueueSubmit2", "vkQueueSubmit2KHR",
        "vkQueueWaitIdle", "vkDeviceWaitIdle", "vkWaitForFences", "vkGetFenceStatus", "vkResetFences",
        "vkDestroyFence", "vkDestroySemaphore", "vkDestroyEvent", "vkWaitSemaphores", "vkWaitSemaphoresKHR",
        "vkSignalSemaphore", "vkSignalSemaphoreKHR", "vkBeginCommandBuffer", "vkEndCommandBuffer",
        "vkResetCommandBuffer", "vkUpdateDescriptorSets", "vkUpdateDescriptorSetWithTemplate",
        "vkUpdateDescriptorSetWithTemplateKHR", "vkSetDebugUtilsObjectNameEXT", "vkResetQueryPool",
        "vkResetQueryPoolEXT", "vkGetEventStatus", "vkSetEvent", "vkResetEvent", NULL};
    for (const char **o = ok; *o; o++)
        if (!strcmp(n, *o)) return (PFN_vkVoidFunction)success;
    if (!strncmp(n, "vkCmd", 5)) return (PFN_vkVoidFunction)nothing;
    return NULL;
}

static VkInstance cur_instance;
static VkDevice cur_device;
static PFN_vkVoidFunction from_instance(const char *n) { return radv_gipa(cur_instance, n); }
static PFN_vkVoidFunction from_device(const char *n) { return radv_gdpa(cur_device, n); }

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL get_device_proc_addr(VkDevice d, const char *n) {
    cur_device = d;
    PFN_vkVoidFunction f = intercept(n, from_device);
    if (f) return f;
    if (!strcmp(n, "vkGetDeviceProcAddr")) return (PFN_vkVoidFunction)get_device_proc_addr;
    return radv_gdpa(d, n);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vk_icdGetInstanceProcAddr(VkInstance inst, const char *n) {
    load();
    if (inst) {
        cur_instance = inst;
        if (!radv_gdpa) radv_gdpa = (PFN_vkGetDeviceProcAddr)radv_gipa(inst, "vkGetDeviceProcAddr");
        if (!strcmp(n, "vkGetDeviceProcAddr")) return (PFN_vkVoidFunction)get_device_proc_addr;
        PFN_vkVoidFunction f = intercept(n, from_instance);
        if (f) return f;
    }
    return radv_gipa(inst, n);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vk_icdGetPhysicalDeviceProcAddr(VkInstance inst, const char *n) {
    load();
    cur_instance = inst;
    PFN_vkVoidFunction f = intercept(n, from_instance);
    if (f) return f;
    return radv_gpdpa ? radv_gpdpa(inst, n) : NULL;
}

EXPORT VKAPI_ATTR VkResult VKAPI_CALL vk_icdNegotiateLoaderICDInterfaceVersion(uint32_t *v) {
    load();
    return radv_negotiate ? radv_negotiate(v) : VK_SUCCESS;
}
