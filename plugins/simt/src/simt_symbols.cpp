// SIMT emulation: kernel names from the ELF symbol tables. A kernel's name comes from dladdr when its
// symbol is exported, else from the static .symtab of the file that holds it (hidden and local
// functions too), demangled; launch records, error messages and the occupancy table use it.
#include "simt_internal.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>

#include <cstdio>
#include <fstream>
#include <iterator>

namespace simt
{
namespace internal
{

std::string demangle(char const* mangled)
{
    int status = 0;
    char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string out = (status == 0 && d != nullptr) ? std::string(d) : std::string(mangled);
    std::free(d);
    return out;
}

// All FUNC symbols of an ELF file's .symtab (the static table: hidden and local functions too).
std::map<uintptr_t, std::string> const& symtabOf(std::string const& file)
{
    auto it = G().symtabs.find(file);
    if (it != G().symtabs.end())
    {
        return it->second;
    }
    std::map<uintptr_t, std::string>& out = G().symtabs[file];
    std::ifstream in(file, std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (data.size() < sizeof(Elf64_Ehdr) || std::memcmp(data.data(), ELFMAG, SELFMAG) != 0
        || data[EI_CLASS] != ELFCLASS64)
    {
        return out;
    }
    Elf64_Ehdr eh;
    std::memcpy(&eh, data.data(), sizeof(eh));
    if (eh.e_shoff == 0 || eh.e_shentsize != sizeof(Elf64_Shdr)
        || eh.e_shoff + static_cast<uint64_t>(eh.e_shnum) * sizeof(Elf64_Shdr) > data.size())
    {
        return out;
    }
    std::vector<Elf64_Shdr> sh(eh.e_shnum);
    std::memcpy(sh.data(), data.data() + eh.e_shoff, eh.e_shnum * sizeof(Elf64_Shdr));
    for (Elf64_Shdr const& s : sh)
    {
        if ((s.sh_type != SHT_SYMTAB && s.sh_type != SHT_DYNSYM) || s.sh_link >= sh.size()
            || s.sh_offset + s.sh_size > data.size())
        {
            continue;
        }
        Elf64_Shdr const& strs = sh[s.sh_link];
        if (strs.sh_offset + strs.sh_size > data.size())
        {
            continue;
        }
        std::size_t const n = s.sh_size / sizeof(Elf64_Sym);
        for (std::size_t i = 0; i < n; ++i)
        {
            Elf64_Sym sym;
            std::memcpy(&sym, data.data() + s.sh_offset + i * sizeof(Elf64_Sym), sizeof(sym));
            if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || sym.st_value == 0 || sym.st_name >= strs.sh_size)
            {
                continue;
            }
            char const* name = data.data() + strs.sh_offset + sym.st_name;
            std::string& slot = out[sym.st_value];
            if (slot.empty() || std::strchr(slot.c_str(), '.') != nullptr) // prefer names without clone suffixes
            {
                slot = name;
            }
        }
    }
    return out;
}

std::string const& kernelName(void const* kernel, char const* signature)
{
    auto it = G().names.find(kernel);
    if (it != G().names.end())
    {
        return it->second;
    }
    std::string name;
    Dl_info info{};
    if (dladdr(kernel, &info) != 0)
    {
        if (info.dli_sname != nullptr && info.dli_saddr == kernel)
        {
            name = demangle(info.dli_sname);
        }
        else if (info.dli_fname != nullptr)
        {
            auto const& tab = symtabOf(info.dli_fname);
            uintptr_t const off = reinterpret_cast<uintptr_t>(kernel) - reinterpret_cast<uintptr_t>(info.dli_fbase);
            auto s = tab.find(off);
            if (s != tab.end())
            {
                name = demangle(s->second.c_str());
            }
        }
    }
    if (name.empty())
    {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "kernel@%p ", kernel);
        name = std::string(buf) + demangle(signature);
    }
    return G().names[kernel] = name;
}

} // namespace internal
} // namespace simt
